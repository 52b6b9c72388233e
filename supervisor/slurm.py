"""Submitting a run to Slurm, and watching and stopping it as a Slurm job. Torch-free.

    run = submit(cfg, "runs", SlurmOptions(nodes=2, procs_per_node=4, partition="gpu", time="2:00:00"))
    # the run folder holds job.sbatch and slurm_job.json (the job id); the RunManager lists the
    # run as `queued` until the job starts, then as the run says (running, paused ...)

The job script starts one torchrun agent per node with `srun`, and the agents meet through
torchrun's c10d rendezvous on the first node of the job (SLURM_JOB_NODELIST); each agent starts
the node's ranks (`python -m engine.worker`). Why srun + torchrun and not DeepSpeed's launcher:
srun starts the agents through slurmd, so no ssh or pdsh is needed between compute nodes (many
clusters forbid it), every process is accounted to the job, and `scancel` ends all of them on
every node; the rendezvous needs only the first node's address, known once the job runs. The
hostfile is still written (`<run>/hostfile`, DeepSpeed's format, built from SLURM_JOB_NODELIST)
as the record of where the ranks ran.

Rank 0 writes control.json into the run folder as on one machine; the folder must be on a file
system the submitting machine shares with the nodes. With several nodes, rank 0's control
socket must listen on an address the submitting machine reaches (control.host, opted into).

A run submitted here is watched by `SlurmHandle` (the RunManager picks it for a folder with
slurm_job.json): alive while the job is pending or running (scontrol), queued while pending,
and Stop asks the run to stop through its control socket, then `scancel`s the job and waits
until Slurm says it ended. A job that ended without the run's own final state is reported with
its Slurm state and the failing rank's last log lines.
"""

from __future__ import annotations

import copy
import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from contract.config.schema import RunConfig
from contract.protocol.commands import Stop
from contract.protocol.states import RunState
from contract.run_folder import EventLog, RunFolder, make_run_folder
from contract.events import StateEvent

from supervisor import stopping
from supervisor.handle import RunHandle
from supervisor.judgement import LOST_PEER, Verdict, last_exception
from supervisor.records import Failure, RunInfo, log_tail, mark_stopping

JOB_FILE = "slurm_job.json"
SCRIPT = "job.sbatch"
RDZV_PORT = 29400  # torchrun's c10d rendezvous on the job's first node, + job id mod 2000
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


class SlurmError(RuntimeError):
    """Slurm refused or failed a request (sbatch, scancel); the message is Slurm's."""


@dataclass(frozen=True)
class SlurmOptions:
    """What the job asks Slurm for. Empty / 0: Slurm's (or the partition's) default."""
    nodes: int = 1
    procs_per_node: int = 0      # ranks per node; 0: the run config's parallel.nproc
    gpus_per_node: int = 0
    cpus_per_task: int = 0       # cores for each node's agent and its ranks
    partition: str = ""
    time: str = ""               # e.g. 2:00:00
    account: str = ""

    def check(self) -> None:
        problems = [f"{name} must be >= {low}, not {value}" for name, value, low in (
            ("nodes", self.nodes, 1), ("procs_per_node", self.procs_per_node, 0),
            ("gpus_per_node", self.gpus_per_node, 0), ("cpus_per_task", self.cpus_per_task, 0))
            if value < low]
        if problems:
            raise ValueError("slurm options: " + "; ".join(problems))


@dataclass(frozen=True)
class JobState:
    """A job as `scontrol show job` describes it."""
    job_id: str
    state: str         # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL ...
    reason: str
    exit_code: str     # "code:signal"
    nodes: str

    @property
    def alive(self) -> bool:
        return self.state in ACTIVE

    @property
    def pending(self) -> bool:
        return self.state in ("PENDING", "CONFIGURING", "REQUEUED")


def job_script(cfg: RunConfig, folder: RunFolder, opts: SlurmOptions, python: str = sys.executable) -> str:
    """The sbatch script of the run (its config already in the folder)."""
    repo = Path(__file__).resolve().parent.parent
    nproc = cfg.parallel.nproc
    run = shlex.quote(str(folder.root))
    sbatch = [f"--job-name=livetune-{folder.root.name}", f"--nodes={opts.nodes}", "--ntasks-per-node=1",
              f"--output={folder.logs}/slurm-%j.log"]
    if cfg.fault.max_restarts > 0:  # a lost node requeues the job; the script resumes it (supervisor.restart)
        sbatch.append("--requeue")
    sbatch += [f"--{name}={value}" for name, value in (
        ("gpus-per-node", opts.gpus_per_node), ("cpus-per-task", opts.cpus_per_task),
        ("partition", opts.partition), ("time", opts.time), ("account", opts.account)) if value]
    return "\n".join([
        "#!/bin/bash",
        *[f"#SBATCH {line}" for line in sbatch],
        "# Written by livetune (supervisor/slurm.py): one torchrun agent per node (srun), meeting on",
        "# the job's first node; each starts this node's ranks of the run.",
        "set -euo pipefail",
        f"RUN={run}",
        f"cd {shlex.quote(str(repo))}",
        f"scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed 's/$/ slots={nproc}/' > \"$RUN/hostfile\"",
        "MASTER=$(head -n 1 \"$RUN/hostfile\" | cut -d ' ' -f 1)",
        f"export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=${{HF_HUB_OFFLINE:-1}} TOKENIZERS_PARALLELISM=false "
        f"LIVETUNE_RUN_DIR=\"$RUN\" "
        f"PYTHONPATH={shlex.quote(str(repo))}${{PYTHONPATH:+:$PYTHONPATH}}",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ${SLURM_CPUS_ON_NODE:-1} / " + str(nproc) + " > 0 ? "
        "${SLURM_CPUS_ON_NODE:-1} / " + str(nproc) + " : 1 ))}",
        *([f"if [ \"${{SLURM_RESTART_COUNT:-0}}\" -gt 0 ]; then {shlex.quote(python)} -m supervisor.restart \"$RUN\"; fi"]
          if cfg.fault.max_restarts > 0 else []),
        launch_line(python, nproc),
        ""])


def launch_line(python: str, nproc: int) -> str:
    """The script's line that starts the ranks (it reads RUN, MASTER and Slurm's variables)."""
    return (f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {shlex.quote(python)} -m torch.distributed.run "
            f"--nnodes=\"$SLURM_JOB_NUM_NODES\" --nproc_per_node={nproc} --rdzv_backend=c10d "
            f"--rdzv_endpoint=\"$MASTER:$(({RDZV_PORT} + SLURM_JOB_ID % 2000))\" --rdzv_id=\"$SLURM_JOB_ID\" "
            "-m engine.worker --run-dir \"$RUN\"")


def submit(cfg: RunConfig, output_dir: str | Path, opts: SlurmOptions, env: dict[str, str] | None = None) -> RunFolder:
    """Make the run's folder, write its sbatch script, submit it, record the job id.
    Raises SlurmError with sbatch's own message when Slurm refuses it."""
    opts.check()
    if shutil.which("sbatch") is None:
        raise SlurmError("sbatch is not installed here: submit from a machine of the Slurm cluster")
    cfg = copy.deepcopy(cfg)
    cfg.logging.output_dir = str(Path(output_dir).resolve())
    cfg.parallel.launcher = "torchrun"  # what the job runs; the ranks read it from config.yaml
    cfg.parallel.nodes = opts.nodes    # the world is nodes x nproc ranks (the config's checks count it)
    if opts.procs_per_node:
        cfg.parallel.nproc = opts.procs_per_node
    folder = make_run_folder(cfg)
    script = folder.root / SCRIPT
    script.write_text(job_script(cfg, folder, opts))
    got = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                         env=env, timeout=60)
    log = EventLog(folder.events)
    try:
        if got.returncode != 0:
            message = f"sbatch refused the job: {got.stderr.strip() or got.stdout.strip()}"
            log.emit(StateEvent(state=RunState.FAILED, source="manager", error=message))
            raise SlurmError(message)
        job_id = got.stdout.strip().split(";")[0]
        (folder.root / JOB_FILE).write_text(json.dumps({"job_id": job_id, "script": str(script),
                                                         "nodes": opts.nodes, "submitted": time.time()}))
        log.emit(StateEvent(state=RunState.STARTING, nproc=cfg.parallel.nproc, slurm_job=job_id,
                            method=cfg.method.name, model=cfg.model.path or "default"))
    finally:
        log.close()
    return folder


def recorded_job(folder: RunFolder) -> str | None:
    """The Slurm job id of a submitted run (None: not a Slurm run)."""
    try:
        return str(json.loads((folder.root / JOB_FILE).read_text())["job_id"])
    except (OSError, ValueError, KeyError):
        return None


def job_state(job_id: str) -> JobState | None:
    """The job's state from scontrol; once Slurm has forgotten the job (MinJobAge), from sacct
    (the accounting database) where it is there; None when neither can say."""
    try:
        got = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return _accounted_state(job_id)
    if got.returncode != 0 or "JobState=" not in got.stdout:
        return _accounted_state(job_id)
    fields = dict(part.split("=", 1) for part in got.stdout.split() if "=" in part)
    return JobState(job_id, fields.get("JobState", "UNKNOWN"), fields.get("Reason", ""),
                    fields.get("ExitCode", ""), fields.get("NodeList", ""))


def _accounted_state(job_id: str) -> JobState | None:
    """The job as `sacct` records it (None: no sacct, accounting off, or no such job). Its state
    may read "CANCELLED by 1000": the first word is the state."""
    if shutil.which("sacct") is None:
        return None
    try:
        got = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,Reason,ExitCode,NodeList"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in got.stdout.splitlines() if got.returncode == 0 else []:
        parts = line.split("|")
        if len(parts) == 5 and parts[0] == job_id and parts[1]:
            return JobState(job_id, parts[1].split()[0], parts[2], parts[3], parts[4])
    return None


def cancel(job_id: str, timeout: float = 60.0) -> JobState | None:
    """scancel the job and wait until Slurm says it is over; its last state (None: forgotten)."""
    state = job_state(job_id)
    if state is None or not state.alive:
        return state
    got = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=30)
    if got.returncode != 0 and (state := job_state(job_id)) is not None and state.alive:
        raise SlurmError(f"scancel {job_id}: {got.stderr.strip()}")
    deadline = time.monotonic() + timeout
    while True:
        state = job_state(job_id)
        if state is None or not state.alive:
            return state
        if time.monotonic() > deadline:
            raise SlurmError(f"job {job_id} is still {state.state} {timeout:g} s after scancel")
        time.sleep(0.5)


class SlurmHandle(RunHandle):
    """A run that is a Slurm job: its processes are the job's (on the nodes, not in a process
    group here), so whether it lives is the job's state."""

    def __init__(self, folder: RunFolder, hang_timeout: float, log_lines: int = 20):
        super().__init__(folder, hang_timeout, log_lines)
        self.job_id = recorded_job(folder) or ""
        self.job: JobState | None = None

    def _observe(self, pid: int | None, members: list) -> None:
        self.job = job_state(self.job_id)
        alive = self.job is not None and self.job.alive
        self._alive = self._launcher_alive = alive
        self._seen_alive = self._seen_alive or alive
        # a job that wrote its final state and still runs: since when (the judgement's bound)
        self._final_seen_at = (self._final_seen_at or time.monotonic()) if self._summary.final and alive else None

    def info(self, refresh: bool = True) -> RunInfo:
        info = super().info(refresh)
        if self.job is not None and self.job.pending and not self._summary.final:
            return replace(info, state=RunState.QUEUED)
        return info

    def _failure_of(self, verdict: Verdict) -> Failure:
        """Why the run failed, the cause first, then Slurm's word on the job once it ended badly;
        for a job that ended without the run's final state, the cause is the exception in the
        log of the rank that failed (the one whose log ends in an exception; else rank 0)."""
        failure = super()._failure_of(verdict)
        job = self.job
        if job is None or job.alive or job.state == "COMPLETED":
            return failure
        slurm = (f"Slurm job {job.job_id} {job.state} (exit code {job.exit_code}"
                 f"{', ' + job.reason if job.reason not in ('', 'None') else ''})")
        if verdict.rank is not None or self._summary.final:
            if LOST_PEER.search(failure.message):  # a victim's view: Slurm's word says more
                return replace(failure, message=f"{slurm}: {failure.message}")
            return replace(failure, message=f"{failure.message}; {slurm}")
        rank, lines = _failing_rank(self.folder, self.log_lines)
        cause = last_exception(lines)
        message = (f"{cause}; rank {rank}, {slurm} without a final state" if cause else
                   f"{slurm} without a final state; rank {rank}: no exception logged")
        return Failure(self.name, verdict.kind.value, message, rank, str(self.folder.rank_log(rank)), lines)

    def stop(self, save: bool = Stop().save, timeout: float = 60.0) -> RunInfo:
        """Ask the run to stop (saving with `save`), give it `timeout` s, then scancel the job
        and wait until Slurm confirms it ended. A job still waiting in the queue is cancelled:
        nothing of it ran, so the run finished, with that as its reason."""
        self.refresh()
        if not self._alive:
            return self.info()
        mark_stopping(self.folder, True)
        try:
            job = self.job
            queued = job is not None and job.pending
            if not queued and stopping.ask_to_stop(self.folder, save, timeout):
                deadline = time.monotonic() + timeout
                while (state := job_state(self.job_id)) is not None and state.state == "RUNNING" \
                        and time.monotonic() < deadline:
                    time.sleep(0.5)
            ended = cancel(self.job_id)
            self.refresh()
            if not self._summary.final:
                if queued and self._summary.run_state in (None, RunState.STARTING):  # no rank wrote a word
                    why = job.reason if job is not None and job.reason not in ("", "None") else "pending"
                    self._record(stopping.cancelled_event(f"Slurm job {self.job_id} was still waiting in "
                                                          f"the queue ({why})"))
                else:
                    forced = ended is not None and ended.state == "CANCELLED"
                    self._record(stopping.forced_stop_event(save, timeout, forced, self._summary.step))
        finally:
            mark_stopping(self.folder, False)
        return self.info()


def _failing_rank(folder: RunFolder, n: int) -> tuple[int, tuple[str, ...]]:
    logs = sorted(folder.logs.glob("rank*.log"), key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else 0)
    for path in logs:
        if not path.stem[4:].isdigit():
            continue
        lines = log_tail(folder, int(path.stem[4:]), n)[1]
        if last_exception(lines):
            return int(path.stem[4:]), lines
    return 0, log_tail(folder, 0, n)[1]


def handle_for(folder: RunFolder, hang_timeout: float, log_lines: int = 20) -> RunHandle:
    """The handle of a run folder: a SlurmHandle for a submitted job, else a process-group one."""
    if recorded_job(folder) is not None:
        return SlurmHandle(folder, hang_timeout, log_lines)
    return RunHandle(folder, hang_timeout, log_lines)
