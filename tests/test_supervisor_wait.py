"""The supervisor on a stand-in process group (no torch, a second each): `wait` is woken by the
exit itself, a group gone without a final state is judged so, and `stop` follows the contract's
Stop rule (save by default; a run that cannot save is told so). Real runs: tests/test_runs.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from contract.protocol.commands import Stop
from supervisor import RunManager
from supervisor.records import adopt_child


def stand_in(runs: Path, name: str, seconds: float) -> subprocess.Popen:
    """A process group that looks like a run of folder runs/name (its argv names the folder),
    started by this process, without a control socket: it sleeps, then exits."""
    root = runs / name
    (root / "logs").mkdir(parents=True)
    code = f"import time; time.sleep({seconds})"
    proc = subprocess.Popen([sys.executable, "-c", code, str(root.resolve())], start_new_session=True)
    (root / "launcher.pid").write_text(str(proc.pid))
    adopt_child(proc)  # reaped the moment it exits, as RunManager.start does for its launchers
    (root / "events.jsonl").write_text(json.dumps({"type": "state", "state": "running", "step": 3}) + "\n")
    return proc


def final_state(runs: Path, name: str) -> dict:
    events = [json.loads(line) for line in (runs / name / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["type"] == "state"][-1]


def test_wait_is_woken_by_the_exit_not_by_a_poll(tmp_path):
    proc = stand_in(tmp_path, "short", 1.5)
    handle = RunManager(tmp_path).get("short")
    assert handle.wait(timeout=0.2) is False and handle.alive
    assert handle.wait(timeout=30) is True
    ended = time.monotonic()
    proc.wait()
    assert time.monotonic() - ended < 5.0  # it had ended: not returned early (a margin for a loaded machine)
    info = handle.info()
    assert (info.state, info.alive) == ("failed", False)
    assert info.error.startswith("exited without a final state")


def test_stop_saves_by_default_and_says_so_when_it_cannot(tmp_path):
    assert Stop().save is True  # the one default: the supervisor's stop takes it from here
    manager = RunManager(tmp_path)
    procs = {name: stand_in(tmp_path, name, 600) for name in ("default", "nosave")}
    members = {name: psutil.Process(p.pid) for name, p in procs.items()}
    info = manager.stop("default", timeout=1)  # no control socket: the group is ended by signal
    assert (info.state, info.alive, info.stopped_by_user) == ("failed", False, True)
    assert "nothing was saved" in info.error
    info = manager.stop("nosave", save=False, timeout=1)
    assert (info.state, info.alive, info.stopped_by_user) == ("finished", False, True)
    assert final_state(tmp_path, "nosave")["source"] == "manager"
    for name, proc in procs.items():
        assert proc.wait(timeout=10) is not None
        assert not members[name].is_running()


def test_the_guard_ends_its_group_when_its_parent_is_killed(tmp_path):
    """`supervisor.guard` leads a terminal's run: SIGKILL of the terminal's command (no handler
    runs) still ends every process of the group, grandchildren included."""
    import os
    import signal
    sleeper = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
               "'import time; time.sleep(600)']); time.sleep(600)")  # a child with a child
    parent_code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-m', "
                   f"'supervisor.guard', sys.executable, '-c', {sleeper!r}], start_new_session=True); "
                   "print(p.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
    guard = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while len(group(guard)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = group(guard)
    assert len(members) == 3, members  # the guard, the launcher stand-in, its child
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while [p for p in members if running(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in members if running(p)]
    for p in left:
        os.kill(p.pid, signal.SIGKILL)
    assert not left


def group(pgid: int) -> list[psutil.Process]:
    import os
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                found.append(p)
        except (OSError, psutil.Error):
            pass
    return found


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
