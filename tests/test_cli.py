"""The terminal entry point end to end: `./launch.sh train` on the embedded default."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(args, tmp_path, timeout=600):
    env = dict(os.environ, LIVETUNE_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "engine.cli", "train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def events_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_default_run_end_to_end(tmp_path):
    out = run_cli(["max_steps=30", f"output_dir={tmp_path / 'runs'}", "run_name=cli",
                   "eval.every_n_steps=15", "eval.max_samples=16"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = tmp_path / "runs" / "cli"
    for name in ("config.yaml", "events.jsonl", "logs/rank0.log", "logs/launcher.log"):
        assert (run_dir / name).exists(), name
    events = events_of(run_dir)
    train = [e for e in events if e["type"] == "train"]
    assert [e["step"] for e in train] == list(range(1, 31))
    for e in train:
        assert {"type", "step", "epoch", "loss", "lr", "tokens_per_s", "time"} <= set(e)
    first, last = sum(e["loss"] for e in train[:5]) / 5, sum(e["loss"] for e in train[-5:]) / 5
    assert last < first * 0.8, (first, last)
    evals = [e for e in events if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [15, 30]
    assert "eval/exact_match" in evals[-1] and "eval/loss" in evals[-1]
    assert events[-1]["type"] == "state" and events[-1]["state"] == "finished"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_bad_config_exits_nonzero_with_every_problem(tmp_path):
    out = run_cli(["nproc=3", "tp=2", "train.nonsense=1", "optim.lr=fast"], tmp_path, timeout=60)
    assert out.returncode == 2
    for words in ("parallel.nproc", "train.nonsense", "optim.lr", "3 problems"):
        assert words in out.stderr, out.stderr
    assert not (tmp_path / "runs").exists()


def test_missing_config_file(tmp_path):
    out = run_cli([str(tmp_path / "nope.yaml")], tmp_path, timeout=60)
    assert out.returncode == 2 and "file not found" in out.stderr
