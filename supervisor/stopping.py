"""Ending a run: asking it to stop through its control socket, then ending its whole process
group (launcher and every rank) and waiting until not even a zombie of it is left.

The default of `save` is the contract's `Stop` command's, here and in every front end: a stop
saves (a training checkpoint, then the final model) unless asked not to.
"""

from __future__ import annotations

import time
from pathlib import Path

from contract.protocol.commands import Stop
from contract.run_folder import RunFolder
from contract.protocol.states import RunState
from contract.events import StateEvent

from supervisor import procs, remote_stop
from supervisor.records import child_running, reap

# What `stop()` does when not told: the one default, declared by the contract's Stop command.


def ask_to_stop(folder: RunFolder, save: bool, timeout: float) -> bool:
    """Send `stop` through the run's control server and wait for it to be taken (at the next
    step boundary); False when there is no server to ask or it did not answer in time."""
    if not folder.control.exists():
        return False
    from supervisor.client import RunClient  # imported late: only a stop needs the client
    try:
        with RunClient.connect(folder.root, timeout=min(5.0, timeout)) as client:
            client.send(Stop(save=save), timeout=timeout)
        return True
    except (OSError, RuntimeError, TimeoutError, ValueError):
        return False  # not listening, refused or too slow: the group is ended instead


def alive(pgid: int | None, root: Path) -> bool:
    """Whether the run whose folder is `root` still has a running process in group `pgid`
    (zombies do not count). A launcher this process started counts from its fork (before its
    command line names the folder); any other group only while a member names the folder: a
    pgid the kernel handed on to an unrelated group after the run ended is not the run's."""
    reap(pgid)
    return child_running(pgid) or procs.group_alive(pgid, root)


def wait_gone(pgid: int | None, root: Path, deadline: float) -> None:
    """Wait (on the processes' exits, re-looking for members at least every 0.5 s) until no
    process of the group runs, or until `deadline` (monotonic)."""
    if pgid is None:
        return
    watch = procs.ExitWatch()
    try:
        while alive(pgid, root) and time.monotonic() < deadline:
            for proc in procs.live(procs.snapshot({pgid})[pgid]):
                watch.add(proc.pid)
            for pid in watch.wait(min(0.5, deadline - time.monotonic())):
                watch.discard(pid)
    finally:
        watch.close()


def end_group(pgid: int | None, root: Path, grace_s: float) -> None:
    """End every process of the run's group: SIGTERM, SIGKILL after `grace_s`; then wait until
    init (or this process, for the launcher) has reaped them all. Nothing is signalled once
    the group is no longer the run's (see `alive`)."""
    if pgid is None or not alive(pgid, root):
        return
    if remote_stop.recorded(root)[0]:  # ranks on other machines: never SIGTERM DeepSpeed's runner
        remote_stop.end(root, grace_s)
        procs.kill_group(pgid, alive=lambda: alive(pgid, root), term=False)
    else:
        procs.kill_group(pgid, grace_s=grace_s, alive=lambda: alive(pgid, root))
    deadline = time.monotonic() + 5.0
    while procs.snapshot({pgid})[pgid] and time.monotonic() < deadline:
        reap(pgid)
        time.sleep(0.05)


def forced_stop_event(save: bool, timeout: float, forced: bool, step: int) -> StateEvent:
    """The final state the manager records for a run that was stopped without writing one."""
    if not forced:  # it went away by itself while being stopped: that is no clean stop
        return StateEvent(state=RunState.FAILED, step=step, stopped_by_user=True,
                          error="exited without a final state while it was being stopped")
    how = f"did not stop by itself within {timeout:g} s and was ended by signal"
    if save:  # the save the user asked for did not happen: that is a failure they must see
        return StateEvent(state=RunState.FAILED, step=step, stopped_by_user=True,
                          error=f"stopped by the user with save, but the run {how}; nothing was saved")
    return StateEvent(state=RunState.FINISHED, step=step, stopped_by_user=True,
                      reason=f"stopped by the user; the run {how}")


def cancelled_event(what: str) -> StateEvent:
    """The final state of a run stopped before any of it started (a Slurm job still queued):
    nothing ran, nothing was lost, so it finished, with `what` happened as its reason."""
    return StateEvent(state=RunState.FINISHED, step=0, stopped_by_user=True,
                      reason=f"cancelled before it started: {what}")
