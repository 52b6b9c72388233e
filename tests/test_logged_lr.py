"""The learning rate in each `train` record is the one that step trained with.

The scheduler advances inside every step strategy (DeepSpeed's engine step, the fused LOMO step,
the pipeline step), so a rate read after the step is the next step's. The trainer reads it before
the step; here a short run of the worker's Trainer (in this process: the rate is the trainer's,
not the process group's) is compared with the schedule's own formula.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.presets import DEFAULT

pytestmark = pytest.mark.slow  # DeepSpeed engines on the default task: the slow tier

STEPS, WARMUP, LR = 7, 3, 1e-3


def _linear_schedule(step: int) -> float:
    """transformers' linear schedule with warmup, written out: the rate of step `step` (1-based),
    which the scheduler computes at its index step - 1."""
    s = step - 1
    if s < WARMUP:
        return LR * s / WARMUP
    return LR * max(0.0, (STEPS - s) / (STEPS - WARMUP))


def _logged_lrs(root: Path, cache: Path, method: str, monkeypatch) -> list[dict]:
    """A short run of the default task in this process (the worker's Trainer, built from the same
    config; no launch: what is tested is the step's rate, not the process group)."""
    from engine.trainer import Trainer
    monkeypatch.setenv("LIVETUNE_CACHE", str(cache))  # the task encoded once for both methods
    cfg = load_config(data=json.loads(json.dumps(DEFAULT)), overrides=[
        f"max_steps={STEPS}", f"optim.warmup_steps={WARMUP}", "optim.scheduler=linear", f"lr={LR}",
        f"method={method}", "batch_size=8", "precision=fp32", "nproc=1", "eval.every_n_steps=0",
        "eval.at_end=false", "checkpoint.save_at_end=false", "logging.tensorboard=false",
        "logging.progress_bar=false", "control.enabled=false", f"output_dir={root}", "run_name=lr"])
    with Trainer(config=cfg) as trainer:
        trainer.train()
    events = [json.loads(line) for line in (root / "lr" / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e.get("type") == "train"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("livetune-cache")


@pytest.mark.parametrize("method", ["full", "lomo"])  # the engine's step, the fused step
def test_each_step_logs_the_rate_it_trained_with(tmp_path, cache, method, monkeypatch):
    train = _logged_lrs(tmp_path, cache, method, monkeypatch)
    assert [e["step"] for e in train] == list(range(1, STEPS + 1))
    expected = [_linear_schedule(step) for step in range(1, STEPS + 1)]
    assert [e["lr"] for e in train] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    # the warmup's first rate is 0 (as transformers' schedule says); the last step's is not
    assert train[-1]["lr"] == pytest.approx(LR / (STEPS - WARMUP)) and train[-1]["lr"] > 0
