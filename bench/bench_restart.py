"""Time from a rank's death to training again: the manager's restart (fault.max_restarts=1) against
a relaunch by hand from the same checkpoint (a person's reaction time not counted: the relaunch
starts the moment the failure is recorded).

    .venv/bin/python bench/bench_restart.py [--nproc 1] [--steps 12]

One run of the tiny default model through the real DeepSpeed launcher, checkpoints every 4 steps,
its rank 0 killed with SIGKILL after step 6. Printed: detection (kill -> `rank_failed` event),
relaunch (`restart` -> the first step trained again) and the total; then the by-hand relaunch
(a new `RunManager.start` with resume=<checkpoint>, from the call to its first step) and the by-hand
total (kill -> the failure recorded -> relaunch -> first step).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from contract.config.load import load_config  # noqa: E402
from contract.run_folder import read_events  # noqa: E402
from control_runs import task_files  # noqa: E402
from supervisor.manager import RunManager  # noqa: E402


def _events(path: Path) -> list[dict]:
    return list(read_events(path)) if path.exists() else []


def _wait(path: Path, test, timeout: float = 900.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = _events(path)
        if test(events):
            return events
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout} s on {path}")


def _trained_past(events: list[dict], step: int) -> bool:
    return any(e["type"] == "train" and e["step"] >= step for e in events)


def _kill_after_step(handle, step: int) -> float:
    """Kill rank 0 once `step` is trained and a checkpoint is complete; the wall time of the kill."""
    _wait(handle.folder.events, lambda ev: _trained_past(ev, step) and any(e["type"] == "checkpoint" for e in ev))
    os.kill(handle.rank_pids()[0], signal.SIGKILL)
    return time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    task = task_files(work / "task")
    base = [f"nproc={args.nproc}", f"max_steps={args.steps}", "batch_size=8", "data.max_length=32",
            f"data.train={task['train']}", f"data.eval={task['eval']}", "precision=fp32",
            "logging.tensorboard=false", "checkpoint.save_at_end=false", "eval.at_end=false",
            "checkpoint.every_n_steps=4", "control.enabled=true"]
    env = {"LIVETUNE_CACHE": task["cache"]}
    with RunManager(work / "runs") as manager:
        manager.start_monitor(interval=0.2)
        # the manager's restart
        auto = manager.start(load_config(overrides=[*base, "run_name=auto", "fault.max_restarts=1"]), env=env)
        killed = _kill_after_step(auto, 6)
        events = _wait(auto.folder.events, lambda ev: any(e["type"] == "restart" for e in ev) and _trained_past(
            ev[[e["type"] for e in ev].index("restart"):], 1))
        cut = [e["type"] for e in events].index("restart")
        failed = next(e for e in events if e["type"] == "rank_failed")["time"]
        again = next(e for e in events[cut:] if e["type"] == "train")["time"]
        print(f"RESULT restart detection_s={failed - killed:.1f} relaunch_s={again - events[cut]['time']:.1f} "
              f"total_s={again - killed:.1f}")
        auto.wait(timeout=900)
        # by hand: the same death, no restart; relaunched from the checkpoint when the failure is recorded
        hand = manager.start(load_config(overrides=[*base, "run_name=hand"]), env=env)
        killed = _kill_after_step(hand, 6)
        _wait(hand.folder.events, lambda ev: any(e.get("state") == "failed" for e in ev))
        hand.wait(timeout=120)
        started = time.time()
        checkpoint = sorted((hand.folder.root / "checkpoints").glob("step-*"))[-1]
        resumed = manager.start(load_config(overrides=[*base, "run_name=hand", f"resume={checkpoint}"]), env=env)
        events = _wait(resumed.folder.events, lambda ev: any(e["type"] == "resume" for e in ev) and _trained_past(
            ev[[e["type"] for e in ev].index("resume"):], 1))
        at = [e["type"] for e in events].index("resume")
        again = next(e for e in events[at:] if e["type"] == "train")["time"]
        print(f"RESULT by_hand relaunch_s={again - started:.1f} total_s={again - killed:.1f} (no reaction time)")
        resumed.wait(timeout=900)


if __name__ == "__main__":
    main()
