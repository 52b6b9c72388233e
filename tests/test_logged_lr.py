"""The learning rate in each `train` record is the one that step trained with.

The scheduler advances inside every step strategy (DeepSpeed's engine step, the fused LOMO step,
the pipeline step), so a rate read after the step is the next step's. The trainer reads it before
the step; here a short run through the real worker is compared with the schedule's own formula.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.presets import DEFAULT

pytestmark = pytest.mark.slow  # engine processes: the slow tier

REPO = Path(__file__).resolve().parents[1]
STEPS, WARMUP, LR = 7, 3, 1e-3


def _linear_schedule(step: int) -> float:
    """transformers' linear schedule with warmup, written out: the rate of step `step` (1-based),
    which the scheduler computes at its index step - 1."""
    s = step - 1
    if s < WARMUP:
        return LR * s / WARMUP
    return LR * max(0.0, (STEPS - s) / (STEPS - WARMUP))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logged_lrs(root: Path, cache: Path, method: str) -> list[dict]:
    cfg = load_config(data=json.loads(json.dumps(DEFAULT)), overrides=[
        f"max_steps={STEPS}", f"optim.warmup_steps={WARMUP}", "optim.scheduler=linear", f"lr={LR}",
        f"method={method}", "batch_size=8", "precision=fp32", "nproc=1", "eval.every_n_steps=0",
        "eval.at_end=false", "checkpoint.save_at_end=false", "logging.tensorboard=false",
        "logging.progress_bar=false", "control.enabled=false", f"output_dir={root}", "run_name=lr"])
    run_dir = root / "lr"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "--num_gpus", "1",
           "--module", "engine.worker", "--run-dir", str(run_dir)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "LIVETUNE_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e.get("type") == "train"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("livetune-cache")


@pytest.mark.parametrize("method", ["full", "lomo"])  # the engine's step, the fused step
def test_each_step_logs_the_rate_it_trained_with(tmp_path, cache, method):
    train = _logged_lrs(tmp_path, cache, method)
    assert [e["step"] for e in train] == list(range(1, STEPS + 1))
    expected = [_linear_schedule(step) for step in range(1, STEPS + 1)]
    assert [e["lr"] for e in train] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    # the warmup's first rate is 0 (as transformers' schedule says); the last step's is not
    assert train[-1]["lr"] == pytest.approx(LR / (STEPS - WARMUP)) and train[-1]["lr"] > 0
