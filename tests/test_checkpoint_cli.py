"""`./launch.sh train CONFIG.yaml resume=latest` continues a run that was killed: the events log
goes on in the same run folder, marked with a resume event, the steps after the checkpoint repeat
the killed run's losses exactly, and at the end the keep-last / keep-best rules have left exactly
the checkpoints they should (2 ranks, ZeRO-2, the real launcher and worker)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_utils import REPO_ROOT, SCRIPTS, tail

sys.path.insert(0, str(SCRIPTS))
from ckpt_common import make_task, overrides  # noqa: E402


def events_of(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "train", *args]


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def kill_when(run: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    """SIGKILL the run's whole process group two steps after a checkpoint at step >= 15 (a crash,
    not a stop: nothing gets the chance to save)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = events_of(run)
        saved = [e["step"] for e in events if e["type"] == "checkpoint" and e["step"] >= 15]
        trained = [e["step"] for e in events if e["type"] == "train"]
        if saved and trained and trained[-1] >= saved[0] + 2:
            os.killpg(int((run / "launcher.pid").read_text()), signal.SIGKILL)
            proc.wait(timeout=60)
            return
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    raise AssertionError("no checkpoint at step 15 or later in time")


@pytest.mark.slow
def test_resume_latest_continues_the_run_exactly(tmp_path):
    from engine.checkpoint import list_checkpoints
    from contract.config.load import load_config

    task = make_task(tmp_path / "task", train_rows=320)
    cfg = load_config(overrides=overrides(task, str(tmp_path / "runs"), "r", 2, [
        "epochs=1", "train.grad_accum=1", "checkpoint.every_n_steps=5", "checkpoint.keep_last=2",
        "checkpoint.keep_best=1", "eval.every_n_steps=10", "checkpoint.save_at_end=true"]))
    config = tmp_path / "run.yaml"
    config.write_text(cfg.to_yaml())
    run = tmp_path / "runs" / "r"
    first = subprocess.Popen(cli(str(config)), cwd=REPO_ROOT, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        kill_when(run, first)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    second = subprocess.run(cli(str(config), "resume=latest"), cwd=REPO_ROOT, env=env(),
                            capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, tail(second.stdout + second.stderr)

    events = events_of(run)
    (resume_at,) = [i for i, e in enumerate(events) if e["type"] == "resume"]
    k = events[resume_at]["step"]
    before = {e["step"]: e["loss"] for e in events[:resume_at] if e["type"] == "train"}
    after = {e["step"]: e["loss"] for e in events[resume_at:] if e["type"] == "train"}
    assert k >= 15 and max(before) > k
    assert sorted(after) == list(range(k + 1, 41))
    assert [after[s] for s in range(k + 1, max(before) + 1)] == [before[s] for s in range(k + 1, max(before) + 1)]
    assert events[-1]["type"] == "state" and events[-1]["state"] == "finished"
    # keep_last 2 + keep_best 1 by eval/loss over the scheduled checkpoints (every 5 steps)
    evals = {e["step"]: e["eval/loss"] for e in events if e["type"] == "eval"}
    best = min(evals, key=lambda s: (evals[s], -s))
    names = [c["name"] for c in list_checkpoints(str(run / "checkpoints"))]
    assert sorted(names) == sorted({"step-35", "step-40", f"step-{best}"})
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # leftovers gone
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-40"
    assert (run / "model" / "model.safetensors").is_file() and (run / "model" / "COMPLETE.json").is_file()
