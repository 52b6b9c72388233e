"""Restarts after a failure (fault.max_restarts, supervisor.restart): the decision's table, then a
real run through the real launcher whose rank is killed with SIGKILL mid-run: the manager records
the failure and the restart, relaunches the group from the latest complete checkpoint in the same
folder, and the run finishes; the steps trained again after the restart repeat the first run's
losses exactly (as a resume by hand from that checkpoint does)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.run_folder import read_events
from control_runs import task_files
from supervisor.client import RunClient
from supervisor.manager import RunManager
from contract.run_folder import EventLog, RunFolder
from supervisor.remote import LAUNCH_MARKER, RemoteLog
from supervisor.restart import decide, requeued
from supervisor.slurm import SlurmOptions, job_script

CKPT = (Path("/r/checkpoints/step-4"), 4)


def test_restart_decisions():
    assert not decide(0, [], 7, CKPT).restart  # off: the failure is the run's
    first = decide(2, [], 7, CKPT)
    assert (first.restart, first.attempt, first.checkpoint, first.step) == (True, 1, CKPT[0], 4)
    assert decide(2, [{"step": 7}], 7, CKPT).attempt == 2
    loop = decide(2, [{"step": 7}, {"step": 7}], 7, CKPT)
    assert not loop.restart and loop.why_not == "gave up after 2 restart(s), each time at step 7: a crash loop"
    assert decide(1, [{"step": 5}], 9, CKPT).why_not == "gave up after 1 restart(s)"
    assert "no complete checkpoint" in decide(1, [], 3, None).why_not


def test_a_requeued_slurm_job_resumes_from_the_latest_complete_checkpoint(tmp_path):
    cfg = load_config(overrides=["fault.max_restarts=2"])
    folder = RunFolder(tmp_path / "r")
    (folder.root / "checkpoints" / "step-4").mkdir(parents=True)
    (folder.root / "checkpoints" / "step-8").mkdir()  # not complete: never resumed from
    (folder.root / "checkpoints" / "step-4" / "COMPLETE.json").write_text("{}")
    folder.config.write_text(cfg.to_yaml())
    log = EventLog(folder.events)
    log.emit({"type": "train", "step": 9, "loss": 1.0})
    log.close()
    script = job_script(cfg, folder, SlurmOptions())
    assert "#SBATCH --requeue" in script and "SLURM_RESTART_COUNT" in script and "-m supervisor.restart" in script
    assert "--requeue" not in job_script(load_config(), folder, SlurmOptions())  # off by default
    assert "step-4" in requeued(folder, 1)
    assert load_config(folder.config).resume == str(folder.root / "checkpoints" / "step-4")
    events = list(read_events(folder.events))
    assert [e["type"] for e in events[1:]] == ["rank_failed", "restart", "state"]
    assert events[1]["step"] == 9 and events[2]["attempt"] == 1
    with pytest.raises(SystemExit, match="more than fault.max_restarts=2"):
        requeued(folder, 3)


def test_a_relaunch_forgets_the_dead_rank_of_the_launch_before_at_once(tmp_path):
    """The restarted group's launcher.log follows the failed launch's: until the new runner logs
    its command (seconds later), the old launch's report of host b's killed rank must not count
    as the new launch's (it did: the restart was judged failed at once and the run gave up)."""
    from supervisor.records import launcher_reported_failure
    from test_remote_ranks import MAPPING, RUNNER, failed, node

    folder = RunFolder(tmp_path / "r")
    folder.logs.mkdir(parents=True)
    log = folder.logs / "launcher.log"
    log.write_text(RUNNER + node("node-a", MAPPING, 1) + node("node-b", MAPPING, 2) + failed("node-b", -9)
                   + "[2026-12-03 18:40:30,001] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', "
                   "'-m', 'engine.worker'] exits with return code = -9\n")
    assert [e.rank for e in RemoteLog(log).poll()] == [1] and launcher_reported_failure(folder)[0] == 9
    with open(log, "a") as f:
        f.write(LAUNCH_MARKER + "\n")  # what spawn writes before the relaunched launcher starts
    assert RemoteLog(log).poll() == [] and launcher_reported_failure(folder) == (None, None)


def _losses(events: list[dict]) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in events if e["type"] == "train"]


def _wait_for(path: Path, what, quiet: float = 400.0) -> list[dict]:
    """The run's events once `what(events)` holds. Bounded by the run's own progress, not by the
    machine's speed: fails the test only when no new event came for `quiet` s (a hang)."""
    seen, deadline = -1, 0.0
    while True:
        events = list(read_events(path))
        if what(events):
            return events
        if len(events) != seen:  # the run said something: it is not hung
            seen, deadline = len(events), time.monotonic() + quiet
        assert time.monotonic() < deadline, [e for e in events if e["type"] in ("state", "rank_failed", "restart")]
        time.sleep(0.1)


def _after_restart(events: list[dict]) -> list[dict]:
    at = [i for i, e in enumerate(events) if e["type"] == "restart"]
    return events[at[-1] + 1:] if at else []


@pytest.mark.slow  # two 1-rank starts through the DeepSpeed launcher
def test_a_killed_rank_restarts_from_the_checkpoint_and_the_run_finishes(tmp_path):
    """Where the rank dies is set by the run's own pauses, not by the machine's speed: the run
    saves a checkpoint while paused at step p (a live `set` just before it), trains on and is
    paused again at q > p, and its rank is killed there. The manager records the failure,
    relaunches the group from step p in the same folder, the steps p+1..q trained again repeat
    the first run's losses exactly, the live setting is in force again, and a stop sent by the
    same client (it finds the new group by itself) finishes the run."""
    task = task_files(tmp_path / "task")
    cfg = load_config(overrides=[
        "run_name=r", "nproc=1", "max_steps=100000", "batch_size=8", "data.max_length=32",
        f"data.train={task['train']}", f"data.eval={task['eval']}", "precision=fp32",
        "logging.tensorboard=false", "checkpoint.save_at_end=false", "eval.at_end=false",
        "checkpoint.every_n_steps=0", "fault.max_restarts=1", "control.enabled=true"])
    with RunManager(tmp_path / "runs") as manager:
        handle = manager.start(cfg, env={"LIVETUNE_CACHE": task["cache"]})
        manager.start_monitor(interval=0.3)
        path = handle.folder.events
        client = RunClient.connect(handle.folder.root, timeout=300)
        _wait_for(path, lambda ev: _losses(ev))
        saved_at = client.pause().step
        client.set(weight_decay=0.2)  # a live change before the checkpoint: in force after the restart
        saved = client.save()
        client.resume()
        _wait_for(path, lambda ev: _losses(ev)[-1][0] >= saved_at + 3)
        killed_at = client.pause().step
        ranks = handle.rank_pids()
        assert ranks, "no rank seen"
        os.kill(ranks[0], signal.SIGKILL)
        # the relaunched group trains past the step it died at; the same client, never told of
        # the restart, reaches the new group (a new control file) and stops it
        _wait_for(path, lambda ev: any(s > killed_at for s, _ in _losses(_after_restart(ev))))
        settings = client.status().settings
        client.stop(save=False)
        client.close()
        events = _wait_for(path, lambda ev: any(e.get("state") in ("finished", "failed")
                                                for e in _after_restart(ev)))
        assert handle.wait(timeout=120), "the run's processes did not end"
        info = handle.info()
    assert info.state.value == "finished", (info, [e for e in events if e["type"] in ("state", "rank_failed")])
    assert settings["weight_decay"] == 0.2, settings
    assert saved.step == saved_at and killed_at >= saved_at + 3
    (failed,) = [e for e in events if e["type"] == "rank_failed"]
    (restarted,) = [e for e in events if e["type"] == "restart"]
    assert failed["rank"] == 0 and ("SIGKILL" in failed["error"] or "signal 9" in failed["error"]), failed
    assert restarted["attempt"] == 1 and restarted["checkpoint"].endswith(f"step-{saved_at}")
    cut = events.index(restarted)
    before, after = dict(_losses(events[:cut])), _losses(events[cut:])
    assert [s for s, _ in after] == list(range(saved_at + 1, after[-1][0] + 1))  # from the checkpoint on
    repeated = range(saved_at + 1, killed_at + 1)
    assert all(dict(after)[s] == before[s] for s in repeated), (before, after)


# A reward function of the user's that takes its rank down the way a native crash or the OOM
# killer would (no exception the engine could catch): from the first step after the run's first
# complete checkpoint on, so a restart from that checkpoint dies at the same step every time.
CRASHING_REWARD = '''
import os
import signal
from pathlib import Path


def dies_once_saved(prompts, completions, **columns):
    saved = Path(os.environ["LIVETUNE_RUN_DIR"], "checkpoints").glob("step-*/COMPLETE.json")
    if any(saved):
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
'''


@pytest.mark.slow  # three 1-rank starts of a tiny GRPO run through the DeepSpeed launcher
def test_a_crash_at_the_same_step_stops_after_max_restarts(tmp_path):
    """A crash loop: the rank dies at step 3 (the first step after the checkpoint of step 2)
    whatever the attempt. With max_restarts=2 the manager relaunches twice from step 2, then the
    third failure is the run's last: its `failed` state, the handle's info and failure say why
    (the rank, its SIGKILL, 'gave up after 2 restart(s), each time at step 2: a crash loop')."""
    task = task_files(tmp_path / "task")
    (tmp_path / "crash_rewards.py").write_text(CRASHING_REWARD)
    cfg = load_config(overrides=[
        "run_name=loop", "nproc=1", "max_steps=50", "objective=grpo", "batch_size=2",
        "grpo.num_generations=2", "grpo.max_completion_length=2", "precision=fp32",
        f"grpo.rewards=[{{function: '{tmp_path}/crash_rewards.py:dies_once_saved'}}]",
        "logging.tensorboard=false", "checkpoint.save_at_end=false", "eval.at_end=false",
        "checkpoint.every_n_steps=2", "fault.max_restarts=2"])
    with RunManager(tmp_path / "runs") as manager:
        handle = manager.start(cfg, env={"LIVETUNE_CACHE": task["cache"]})
        manager.start_monitor(interval=0.3)
        events = _wait_for(handle.folder.events, lambda ev: any(
            e["type"] == "state" and e.get("state") == "failed" and e.get("source") == "manager" for e in ev))
        assert handle.wait(timeout=120), "the run's processes did not end"
        handle.wait_cleaned_up(60)
        info, failure = handle.info(), handle.failure()
    failures = [e for e in events if e["type"] == "rank_failed"]
    restarts = [e for e in events if e["type"] == "restart"]
    assert [e["step"] for e in failures] == [2, 2] and all(e["rank"] == 0 for e in failures), failures
    assert all("SIGKILL" in e["error"] or "signal 9" in e["error"] for e in failures), failures
    assert [(e["attempt"], e["max_restarts"], e["step"]) for e in restarts] == [(1, 2, 2), (2, 2, 2)]
    assert all(r["checkpoint"].endswith("step-2") for r in restarts)
    # each attempt trained step 3's batch no further than its reward: no train event past step 2
    assert max(s for s, _ in _losses(events)) == 2
    final = events[-1]
    why = "gave up after 2 restart(s), each time at step 2: a crash loop"
    assert final["state"] == "failed" and final["rank"] == 0 and why in final["error"], final
    assert ("SIGKILL" in final["error"] or "signal 9" in final["error"]), final
    assert info.state.value == "failed" and why in info.error and info.failed_rank == 0, info
    assert failure is not None and why in failure.message and failure.rank == 0, failure
    assert handle.restarts == 2
