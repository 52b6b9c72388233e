"""Restarts after a failure (`fault.max_restarts`): what torchrun's `--max-restarts` and Slurm's
`--requeue` give, for a run the manager watches.

When the judgement (supervisor.judgement) finds a rank dead or hung, the manager ends what is left
of the group (as for any failure) and then, while restarts are left, relaunches the *whole* group
in the same run folder from its latest complete checkpoint: `config.yaml` gets `resume=` that
checkpoint, the launcher starts again, rank 0 writes a new control file (front ends' clients find
it there and reconnect), and the inbox, the data sources and the live settings come back from the
checkpoint as in any resume. The event log records the failure (`rank_failed`: which rank, why)
and the restart (`restart`: attempt, checkpoint). Steps after the checkpoint are trained again.

A crash loop ends: each restart counts, whatever step it fails at; after `max_restarts` the next
failure is the run's final one, its message naming the cause and, when every failure came at the
same step, saying so. Nothing to restart from (no complete checkpoint yet) also ends the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import psutil

from contract.config.load import load_config
from contract.config.schema import RunConfig
from contract.events import EventType, RankFailedEvent, RestartEvent, StateEvent
from contract.protocol.states import RunState
from contract.run_folder import EventLog, RunFolder, read_events

COMPLETE = "COMPLETE.json"  # a checkpoint's completion marker (engine.checkpoint.publish)
STARTER = "starter.json"  # the process that started the run (it alone restarts it): pid, start time
RELAUNCH_WAIT_S = 120.0  # the longest a watcher waits for a restart's group to appear


@dataclass(frozen=True)
class Decision:
    """Whether to relaunch, from which checkpoint, and (when not) why the run ends."""
    restart: bool
    attempt: int = 0
    checkpoint: Path | None = None
    step: int | None = None
    why_not: str = ""


def latest_complete(folder: RunFolder) -> tuple[Path, int] | None:
    """The run's newest complete training checkpoint and its step (the `latest` pointer when
    it names a complete one, else the highest complete step-N), or None."""
    checkpoints = folder.root / "checkpoints"
    pointer = checkpoints / "latest"
    candidates = sorted((p for p in checkpoints.glob("step-*") if (p / COMPLETE).is_file()),
                        key=lambda p: _step_of(p.name))
    if pointer.is_file():
        named = checkpoints / pointer.read_text().strip()
        if (named / COMPLETE).is_file():
            return named, _step_of(named.name)
    return (candidates[-1], _step_of(candidates[-1].name)) if candidates else None


def _step_of(name: str) -> int:
    tail = name.split("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def earlier_failures(folder: RunFolder) -> list[dict]:
    """The `rank_failed` events the run has had (each one was followed by a restart)."""
    return [e for e in read_events(folder.events) if e.get("type") == EventType.RANK_FAILED.value]


def decide(max_restarts: int, failures_before: list[dict], step: int,
           latest: tuple[Path, int] | None) -> Decision:
    """Restart or not (a pure function: the tests' table). `failures_before`: the run's earlier
    `rank_failed` events; `step`: the step the group had reached when it failed."""
    attempt = len(failures_before) + 1
    if max_restarts <= 0:
        return Decision(False, why_not="")  # restarts off: the failure is the run's, as before
    if attempt > max_restarts:
        steps = {e.get("step") for e in failures_before} | {step}
        loop = f", each time at step {step}: a crash loop" if len(steps) == 1 else ""
        return Decision(False, why_not=f"gave up after {max_restarts} restart(s){loop}")
    if latest is None:
        return Decision(False, why_not="no complete checkpoint to restart from (set checkpoint.every_n_steps)")
    return Decision(True, attempt=attempt, checkpoint=latest[0], step=latest[1])


def prepare(folder: RunFolder, decision: Decision, failure_rank: int | None, failure_kind: str,
            message: str, failed_step: int) -> RunConfig:
    """Record the failure and the restart, and point the run's config at the checkpoint: the
    config the relaunched group reads (`config.yaml`)."""
    cfg = load_config(folder.config)
    cfg.resume = str(decision.checkpoint)
    folder.config.write_text(cfg.to_yaml())
    log = EventLog(folder.events)
    try:
        log.emit(RankFailedEvent(step=failed_step, rank=failure_rank, kind=failure_kind, error=message,
                                 source="manager"))
        log.emit(RestartEvent(step=decision.step, attempt=decision.attempt, max_restarts=cfg.fault.max_restarts,
                              checkpoint=str(decision.checkpoint), source="manager"))
        # the run is starting again: readers of the log (RunSummary) see it live, not failed
        log.emit(StateEvent(state=RunState.STARTING, step=decision.step, source="manager",
                            nproc=cfg.parallel.nproc, method=cfg.method.name))
    finally:
        log.close()
    return cfg


def record_starter(folder: RunFolder) -> None:
    """Note this process as the run's starter, so that other watchers of the run (another front
    end, a client following its events) know a relaunch may come while it lives."""
    me = psutil.Process()
    (folder.root / STARTER).write_text(json.dumps({"pid": me.pid, "started": me.create_time()}))


def starter_lives(folder: RunFolder) -> bool:
    """Whether the process that started the run still runs (the same process: its pid and its
    start time; a pid used again by another process does not count)."""
    try:
        noted = json.loads((folder.root / STARTER).read_text())
        return psutil.Process(int(noted["pid"])).create_time() == noted["started"]
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return False


def relaunch_may_come(folder: RunFolder) -> bool:
    """With none of the run's processes alive: whether its starter may still relaunch the group
    (a watcher then waits for it instead of calling the run over). It may while it lives and
    either the relaunch is under way (the log's last state is the manager's `starting`) or the
    run failed (or died without saying so) and `decide` would restart it."""
    if not starter_lives(folder):
        return False
    events = list(read_events(folder.events))
    states = [e for e in events if e.get("type") == EventType.STATE.value]
    last = states[-1] if states else {}
    if last.get("state") == RunState.STARTING.value and last.get("source") == "manager":
        return True
    if last.get("state") == RunState.FINISHED.value or last.get("source") == "manager":
        return False  # over: finished, or the manager recorded the failure as final
    try:
        max_restarts = load_config(folder.config).fault.max_restarts
    except Exception:  # noqa: BLE001 - no readable config: nothing to restart with
        return False
    failures = [e for e in events if e.get("type") == EventType.RANK_FAILED.value]
    return decide(max_restarts, failures, _last_step(folder), latest_complete(folder)).restart


def requeued(folder: RunFolder, restart_count: int) -> str:
    """A Slurm job requeued (`--requeue`, SLURM_RESTART_COUNT = `restart_count` > 0): point the
    run at its latest complete checkpoint and record the restart, before the ranks start again.
    Returns what the job script prints; raises SystemExit when the run must not go on."""
    cfg = load_config(folder.config)
    if restart_count > cfg.fault.max_restarts:
        raise SystemExit(f"requeued {restart_count} times, more than fault.max_restarts={cfg.fault.max_restarts}")
    latest = latest_complete(folder)
    if latest is None:  # nothing saved yet: the run starts over from its beginning
        return "requeued before any complete checkpoint: the run starts from its beginning"
    decision = Decision(True, attempt=restart_count, checkpoint=latest[0], step=latest[1])
    prepare(folder, decision, None, "requeued", "the Slurm job was requeued (a node failed or was preempted)",
            _last_step(folder))
    return f"requeued (restart {restart_count}): resuming from {latest[0]}"


def _last_step(folder: RunFolder) -> int:
    steps = [e.get("step") for e in read_events(folder.events) if e.get("type") == EventType.TRAIN.value]
    return max((s for s in steps if isinstance(s, int)), default=0)


if __name__ == "__main__":  # the Slurm job script's line (supervisor.slurm.job_script)
    import os
    import sys

    print(requeued(RunFolder(Path(sys.argv[1])), int(os.environ.get("SLURM_RESTART_COUNT", "0"))), flush=True)
