"""`python -m supervisor.guard LAUNCHER ARGS...`: run a launcher as the leader of a run's process
group, and end the whole group when the process that started it ends, however it ends.

For a run owned by a terminal (`./launch.sh train` without --detach). The kernel sends the guard
SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), even by SIGKILL, when no handler of the
parent can run. That signal comes when the parent's *thread* ends: a guard started by a thread
that ends first (a restart, from the thread that ended the failed group) is started with
`--watch-parent` and looks at its parent's pid instead, every WATCH_S (it changes when the
parent process is gone, however it ended). A launcher alone would not do: no launcher ends its group when its parent dies, and
DeepSpeed's runner (a hostfile's run) dies on SIGTERM without passing it on, leaving its ranks behind. The guard passes the launcher's exit code on, so to
the supervisor it is the launcher. Torch-free, and small: it lives as long as the run.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from supervisor import remote_stop
from supervisor.procs import live, snapshot

_PR_SET_PDEATHSIG = 1
GRACE_S = 10.0  # SIGTERM first (the launchers end their ranks on it), SIGKILL after this
WATCH_S = 0.5  # --watch-parent: how often the parent's pid is looked at


def _end_group(signum: int, frame: object) -> None:
    """End every process of the group (the guard's own), then the guard. A run with ranks on
    other machines is ended there by its run folder, and its group here by SIGKILL alone: a
    SIGTERM would make DeepSpeed's runner pkill every DeepSpeed launch on those machines
    (supervisor.remote_stop)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM reaches the guard too
    pgid = os.getpgrp()
    root = _run_dir(sys.argv)
    if root is not None and remote_stop.recorded(root)[0]:
        remote_stop.end(root, GRACE_S)
        os.killpg(pgid, signal.SIGKILL)  # the guard included
    os.killpg(pgid, signal.SIGCONT)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and _others_alive(pgid):
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)  # the guard included


def _run_dir(argv: list[str]) -> Path | None:
    """The run folder the launcher's command names (`engine.worker --run-dir FOLDER`)."""
    if "--run-dir" in argv[:-1]:
        return Path(argv[argv.index("--run-dir") + 1])
    return None


def _others_alive(pgid: int) -> bool:
    return any(p.pid != os.getpid() for p in live(snapshot({pgid})[pgid]))


def _watch_parent(parent: int) -> None:
    """End the group once the guard's parent process is gone (its parent pid then changes)."""
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    os.kill(os.getpid(), signal.SIGTERM)  # handled by _end_group in the main thread


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m supervisor.guard LAUNCHER [ARGS...]", file=sys.stderr)
        return 2
    watch = argv[0] == "--watch-parent"
    argv = argv[1:] if watch else argv
    parent = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _end_group)
    if not watch:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request was in place
        _end_group(signal.SIGTERM, None)
    if watch:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    launcher = subprocess.Popen(argv)
    code = launcher.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
