"""The one place that looks at processes: a run's process group, its members, which of them are
ranks, how a dead rank ended, and ending the group. Linux only (the whole project is); torch-free.

psutil does the reading; the only thing it cannot tell, the wait status a zombie carries until
its parent reaps it, is read from /proc/<pid>/stat here and nowhere else.

A run's launcher is started in its own session, so its pid is the group id of the launcher and
of every rank it starts. A rank is a group member running `python -m engine.worker` whose parent
is not itself a worker (a data-loader worker forked by a rank has the same command line).
"""

from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

WORKER_MODULE = "engine.worker"


@dataclass(frozen=True)
class Proc:
    """One process, as seen at one moment."""
    pid: int
    ppid: int
    pgid: int
    zombie: bool         # exited, not yet reaped by its parent
    exit_status: int | None  # raw wait status, known for a zombie only
    argv: tuple[str, ...]

    @property
    def is_worker(self) -> bool:
        """Runs `python -m engine.worker` (the launchers name the module further on, after
        their own `-m deepspeed.launcher...` / `-m torch.distributed.run`)."""
        if "-m" not in self.argv:
            return False
        at = self.argv.index("-m")
        return self.argv[at + 1:at + 2] == (WORKER_MODULE,)


def _zombie_exit_status(pid: int) -> int | None:
    """The wait status a zombie holds (/proc/<pid>/stat field 52; psutil does not read it)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    return int(text.rsplit(")", 1)[1].split()[-1])


def read_proc(pid: int) -> Proc | None:
    """The process `pid`, or None once it is gone (reaped)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            zombie = proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
            ppid = proc.ppid()
            try:
                argv = tuple(proc.cmdline())
            except psutil.ZombieProcess:
                argv = ()
        pgid = os.getpgid(pid)
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None
    except psutil.AccessDenied:
        return None
    return Proc(pid, ppid, pgid, zombie, _zombie_exit_status(pid) if zombie else None, argv)


def snapshot(pgids: set[int]) -> dict[int, list[Proc]]:
    """The members of each process group in `pgids` (zombies included), from one pass."""
    groups: dict[int, list[Proc]] = {pgid: [] for pgid in pgids}
    if not pgids:
        return groups
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) not in groups:
                continue
        except OSError:
            continue
        proc = read_proc(pid)
        if proc is not None and proc.pgid in groups:
            groups[proc.pgid].append(proc)
    return groups


def live(members: list[Proc]) -> list[Proc]:
    return [p for p in members if not p.zombie]


def group_alive(pgid: int | None, run_dir: Path | None = None) -> bool:
    """Whether any process of the group is still running (a group of zombies is gone). With
    `run_dir`: and the group is still that run's. Once a run's processes are gone the kernel
    may hand its pid to an unrelated process that leads a group of its own (pids wrap at
    pid_max, 32768 by default, within minutes on a busy machine); that group must never be
    taken for the run's, let alone signalled."""
    if pgid is None:
        return False
    members = live(snapshot({pgid})[pgid])
    return bool(members) and (run_dir is None or belongs_to(members, run_dir))


def running(pid: int | None) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    proc = read_proc(pid) if pid is not None else None
    return proc is not None and not proc.zombie


def belongs_to(members: list[Proc], run_dir: Path) -> bool:
    """Whether this group is the run's (and not an unrelated group that reuses an old pid)."""
    root = str(run_dir)
    return any(root in p.argv or f"--run-dir={root}" in p.argv for p in members)


def ranks(members: list[Proc]) -> dict[int, Proc]:
    """rank -> process, for the group's rank processes (data-loader children left out)."""
    workers = {p.pid: p for p in members if p.is_worker}
    found: dict[int, Proc] = {}
    for proc in workers.values():
        if proc.ppid in workers:
            continue
        rank = rank_of(proc)
        if rank is not None:
            found[rank] = proc
    return found


def rank_of(proc: Proc) -> int | None:
    """The global rank of a worker: RANK in its environment, else DeepSpeed's --local_rank."""
    try:
        rank = psutil.Process(proc.pid).environ().get("RANK")
        if rank is not None:
            return int(rank)
    except (psutil.Error, ValueError):
        pass
    for arg in proc.argv:
        if arg.startswith("--local_rank="):
            return int(arg.split("=", 1)[1])
    return None


# -- exit statuses in words -------------------------------------------------------------------

def describe_status(status: int | None) -> str:
    """A wait status in words: 'exit code 1', 'signal SIGKILL', or 'unknown exit status'."""
    if status is None:
        return "unknown exit status"
    if os.WIFSIGNALED(status):
        return f"signal {signal_name(os.WTERMSIG(status))}"
    if os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


def describe_returncode(code: int) -> str:
    """A Popen return code in words (negative: ended by that signal)."""
    return f"signal {signal_name(-code)}" if code < 0 else f"exit code {code}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def failed_status(status: int | None) -> bool:
    """A rank that ended this way did not finish normally (None: nobody saw how it ended)."""
    return status is None or status != 0


def ended_by_sigterm(status: int | None) -> bool:
    """SIGTERM is how a launcher ends the other ranks after one died: a victim, not a cause."""
    return status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


# -- acting on a group ------------------------------------------------------------------------

def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def kill_group(pgid: int, grace_s: float = 10.0, run_dir: Path | None = None,
               alive: Callable[[], bool] | None = None, term: bool = True) -> None:
    """SIGTERM the whole process group, then SIGKILL what is left after `grace_s`. A stopped
    (SIGSTOP) process cannot act on SIGTERM until it is continued, so it is continued first.
    `run_dir` (or the `alive` test): signal only while the group is still that run's (see
    group_alive); without either, the caller vouches that `pgid` is its own. `term=False`:
    SIGKILL at once, for a group whose SIGTERM handlers must not run (supervisor.remote_stop)."""
    still = alive or (lambda: group_alive(pgid, run_dir))
    steps = ((signal.SIGCONT, 0.0), (signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)) if term else \
        ((signal.SIGKILL, 2.0),)
    for sig, wait in steps:
        if not still() or not signal_group(pgid, sig):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not still():
                return
            time.sleep(0.05)


class ExitWatch:
    """Wakes as soon as a watched process exits (pidfds, Linux >= 5.3), so a dead rank is seen
    the moment it dies, before the launcher reaps it and ends the others."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> pidfd

    def __len__(self) -> int:
        return len(self._fds)

    def add(self, pid: int) -> None:
        if pid in self._fds:
            return
        try:
            self._fds[pid] = os.pidfd_open(pid)
        except (OSError, AttributeError):
            pass  # already gone, or no pidfds here: the next look sees it

    def discard(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def wait(self, timeout: float) -> list[int]:
        """Pids that have exited, waiting up to `timeout` s for the first one (with nothing to
        watch, it just waits)."""
        if not self._fds:
            time.sleep(max(0.0, timeout))
            return []
        poller = select.poll()
        by_fd = {fd: pid for pid, fd in self._fds.items()}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        return [by_fd[fd] for fd, _ in poller.poll(max(0.0, timeout) * 1000)]

    def close(self) -> None:
        for pid in list(self._fds):
            self.discard(pid)
