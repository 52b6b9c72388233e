"""The small value types of the run manager, and the bits of the run folder it reads besides
events: the launcher's pid, its exit code, log tails."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from contract.run_folder import RunFolder, tail_lines
from contract.protocol.states import RunState

from supervisor.procs import read_proc, running
from supervisor.remote import LAUNCH_MARKER, wait_status


@dataclass(frozen=True)
class RunInfo:
    """One run, as a listing shows it."""
    name: str
    path: str
    state: RunState
    alive: bool                   # whether any process of the run's group is still there
    step: int
    total_steps: int | None
    metrics: dict[str, float]     # the latest training record's numbers and eval/... results
    start_time: float | None      # time.time() of the run's first event
    end_time: float | None        # time of its final state event
    error: str | None             # why it failed
    failed_rank: int | None
    pid: int | None               # the launcher's pid = the run's process group id
    stopped_by_user: bool = False
    reason: str | None = None     # why a finished run ended early (a stop, a job cancelled in the queue)

    @property
    def progress(self) -> float | None:
        """Fraction of the training steps done (None before the run knows its total)."""
        return self.step / self.total_steps if self.total_steps else None


@dataclass(frozen=True)
class Failure:
    """What went wrong with a run: which rank (None: not known or not one rank), and the last
    lines of the log that shows it."""
    run: str
    kind: str                     # a supervisor.judgement.VerdictKind value
    message: str
    rank: int | None
    log: str                      # the log file `lines` come from ("" for several)
    lines: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        where = f" (last lines of {Path(self.log).name})" if self.log else ""
        return f"run {self.run}: {self.message}{where}\n" + "\n".join(self.lines)


def read_pid(folder: RunFolder) -> int | None:
    """The launcher's pid from launcher.pid (written by supervisor.launch.spawn)."""
    try:
        return int((folder.root / "launcher.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def launcher_reported_success(folder: RunFolder) -> set[int]:
    """Pids the DeepSpeed launcher logged as having exited cleanly."""
    text = "\n".join(tail_lines(folder.logs / "launcher.log", 200))
    return {int(pid) for pid in re.findall(r"Process (\d+) exits successfully", text)}


# The launcher's word on the first rank it saw fail, in the latest launch's part of its log.
# DeepSpeed's launch.py: "<the last command it started> exits with return code = -9" (no pid;
# lines from other machines come prefixed with their host name, read by supervisor.remote);
# torchrun: "exitcode  : -9 (pid: 1234)".
_LAUNCH_START = re.compile(r"\[runner\.py:\d+:main\] cmd = ")
_DS_FAILED = re.compile(r"^\[[^\]]*\].*\[launch\.py:\d+:sigkill_handler\] .* exits with return code = (-?\d+)")
_TORCHRUN_FAILED = re.compile(r"exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")


_SPAWNED = re.compile(r"^\[[^\]]*\].*\[launch\.py:\d+:main\] process (\d+) spawned with command: .*'--local_rank=(\d+)'")


def _launch_starts(lines: list[str]) -> list[int]:
    """Indexes of the lines where a launch begins (spawn's marker, the DeepSpeed runner's line)."""
    return [i for i, line in enumerate(lines)
            if line == LAUNCH_MARKER or _LAUNCH_START.search(line) and line.startswith("[")]


def launcher_spawned(folder: RunFolder) -> dict[int, int]:
    """rank -> pid of the ranks the run's launcher on this machine started in its latest launch
    (DeepSpeed's launch.py logs each; on one machine a rank is its local rank)."""
    lines = tail_lines(folder.logs / "launcher.log", 400)
    starts = _launch_starts(lines)
    found = {}
    for line in lines[starts[-1] if starts else 0:]:
        if (m := _SPAWNED.match(line)) is not None:
            found[int(m[2])] = int(m[1])
    return found


def launcher_reported_failure(folder: RunFolder) -> tuple[int | None, int | None]:
    """(wait status, pid or None) of the first rank the run's own launcher reported failing on
    this machine; (None, None) when it reported none."""
    lines = tail_lines(folder.logs / "launcher.log", 400)
    starts = _launch_starts(lines)
    for line in lines[starts[-1] if starts else 0:]:
        if (ds := _DS_FAILED.match(line)) is not None:
            return wait_status(int(ds[1])), None
        if (tr := _TORCHRUN_FAILED.search(line)) is not None:
            return wait_status(int(tr[1])), int(tr[2])
    return None, None


# Lines that explain no failure, left out of a failure's "last lines": torch's c10d store logs
# this on every machine whose reverse DNS lookup of a peer fails (a host known by address only).
HARMLESS = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved")


def _last_lines(path: Path, n: int) -> list[str]:
    """The last `n` lines of a log that say something (HARMLESS lines left out)."""
    return [ln for ln in tail_lines(path, 4 * n) if not HARMLESS.search(ln)][-n:]


def log_tail(folder: RunFolder, rank: int | None, n: int) -> tuple[str, tuple[str, ...]]:
    """(log path, last lines) of one rank's log; for no rank, every rank's log (headed), or
    the launcher's when no rank wrote one."""
    if rank is not None:
        path = folder.rank_log(rank)
        return str(path), tuple(_last_lines(path, n))
    logs = sorted(folder.logs.glob("rank*.log"))
    if not logs:
        path = folder.logs / "launcher.log"
        return str(path), tuple(_last_lines(path, n))
    if len(logs) == 1:
        return str(logs[0]), tuple(_last_lines(logs[0], n))
    lines: list[str] = []
    for path in logs:
        lines += [f"--- {path.name} ---", *_last_lines(path, n)]
    return "", tuple(lines)


# Launchers this process started, shared by every manager in the process: whichever one looks
# at the run learns the launcher's exit code.
_children: dict[int, subprocess.Popen] = {}
_children_lock = threading.Lock()


def adopt_child(proc: subprocess.Popen) -> None:
    """Keep the launcher's Popen, and reap it the moment it exits (a thread waits on it), so a
    finished run leaves no zombie even when nobody looks at it."""
    with _children_lock:
        _children[proc.pid] = proc
    threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()


def reap(pid: int | None) -> int | None:
    """The exit code of launcher `pid` if this process started it and it has ended, else None.
    (The reaper thread's `wait` may hold the Popen's lock; `poll` then answers None although the
    launcher has ended: the code arrives on a later look.)"""
    with _children_lock:
        proc = _children.get(pid) if pid is not None else None
    return proc.poll() if proc is not None else None


def child_running(pid: int | None) -> bool:
    """Whether `pid` is a launcher this process started that has not ended. (Right after the
    fork its command line is still ours, so /proc cannot tell yet whose it is.) Not `poll()`:
    while the reaper thread waits on the launcher, `poll()` answers None even for a zombie; the
    process table says whether it still runs."""
    with _children_lock:
        proc = _children.get(pid) if pid is not None else None
    if proc is None or proc.returncode is not None:
        return False
    seen = read_proc(proc.pid)
    return seen is not None and not seen.zombie


# A stop in progress, whichever manager (or process) is doing it: the others must not take the
# group's end for a failure while it is being ended.
STOP_MARKER = "stop_requested"


def mark_stopping(folder: RunFolder, on: bool) -> None:
    marker = folder.root / STOP_MARKER
    if on:
        marker.write_text(str(os.getpid()))
    else:
        marker.unlink(missing_ok=True)


def stop_in_progress(folder: RunFolder) -> bool:
    """Whether a living process is stopping this run now (a marker left by a dead one is ignored)."""
    try:
        pid = int((folder.root / STOP_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return running(pid)
