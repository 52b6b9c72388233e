"""A run's pid outlives its processes: once its group is gone, the kernel may hand the number to
an unrelated process that leads a group of its own (pids wrap at pid_max within minutes on a busy
machine; a neighbour test worker's launcher was once SIGTERMed this way). Ending a run's group
must signal only a group that is still the run's."""

from __future__ import annotations

import subprocess
import sys
import time

from supervisor import procs, stopping

SLEEPER = "import time; time.sleep(120)"


def start(*argv: str) -> subprocess.Popen:
    """A group leader (its own session, as a run's launcher is) running python with `argv`,
    returned once its command line is its own (exec'd)."""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, *argv], start_new_session=True)
    deadline = time.monotonic() + 60
    while (seen := procs.read_proc(proc.pid)) is None or seen.argv[-len(argv):] != argv:
        assert time.monotonic() < deadline and proc.poll() is None, "the process did not start"
        time.sleep(0.02)
    return proc


def test_a_group_that_does_not_name_the_run_folder_is_left_alone(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stranger = start("--run-dir", str(tmp_path / "another-run"))  # took the old run's pid
    try:
        assert procs.group_alive(stranger.pid) and not procs.group_alive(stranger.pid, run_dir)
        assert not stopping.alive(stranger.pid, run_dir)
        stopping.end_group(stranger.pid, run_dir, grace_s=1.0)
        procs.kill_group(stranger.pid, grace_s=1.0, run_dir=run_dir)
        assert stranger.poll() is None, "an unrelated group was signalled"
    finally:
        stranger.kill()
        stranger.wait()


def test_the_runs_own_group_is_ended(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ours = start("--run-dir", str(run_dir))
    assert stopping.alive(ours.pid, run_dir)
    procs.kill_group(ours.pid, grace_s=5.0, run_dir=run_dir)
    assert ours.wait(timeout=10) < 0  # ended by a signal
    assert not procs.group_alive(ours.pid, run_dir)
