"""A preference run resumed from a checkpoint repeats the uninterrupted run's losses and reward
metrics exactly; its metrics reach the event log and the CSV sink (which TensorBoard and W&B read
alike: every number of a train record). One rank, in this process: DPO with full fine-tuning under
ZeRO-3 (the frozen reference is rebuilt partitioned at resume) and KTO with LoRA (the reference is
the policy without its adapter)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from contract.config.load import load_config
from engine.callbacks import Callback

pytestmark = pytest.mark.slow  # engine processes: the slow tier

STEPS = 6


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from conftest import save_tiny_llama
    from engine.data.default_task import make_examples, preference_row, unpaired_rows
    work = tmp_path_factory.mktemp("pref")
    save_tiny_llama(work / "model")
    rows = make_examples(48, seed=0)
    (work / "pairs.jsonl").write_text("".join(json.dumps(preference_row(r)) + "\n" for r in rows))
    (work / "unpaired.jsonl").write_text("".join(json.dumps(u) + "\n" for r in rows for u in unpaired_rows(r)))
    return work


def _config(work: Path, objective: str, method: str, zero: int, out: Path, *extra: str):
    data = work / ("unpaired.jsonl" if objective == "kto" else "pairs.jsonl")
    return load_config(overrides=[
        f"model.path={work / 'model'}", f"data.train={data}", f"data.eval={data}", "eval.every_n_steps=3",
        "eval.max_samples=8", "eval.batch_size=4", f"objective={objective}", f"method={method}",
        f"zero_stage={zero}", f"max_steps={STEPS}", "batch_size=4", "train.grad_accum=2", "lr=5e-3",
        "precision=fp32", "preference.beta=0.5", "data.batching=random", "eval.at_end=false",
        "checkpoint.save_at_end=false", "control.enabled=false", "logging.tensorboard=false",
        f"output_dir={out}", "run_name=run", *extra])


class Record(Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, loss):
        self.steps.append({"loss": loss, **trainer.train_fn.metrics})


@pytest.mark.parametrize("objective, method, zero", [("dpo", "full", 3), ("kto", "lora", 0)])
def test_resumed_preference_run_repeats_the_uninterrupted_one(inputs, tmp_path, objective, method, zero):
    from engine.trainer import Trainer
    full = Record()
    trainer = Trainer(config=_config(inputs, objective, method, zero, tmp_path, "checkpoint.every_n_steps=3",
                                     "logging.csv=true"), callbacks=[full])
    trainer.train()
    folder = trainer.folder
    trainer.close()
    assert len(full.steps) == STEPS and "rewards/chosen" in full.steps[-1] and "logps/rejected" in full.steps[-1]
    assert full.steps[-1]["rewards/chosen"] != 0.0  # the policy moved away from its reference

    resumed_steps = Record()
    resumed = Trainer(config=_config(inputs, objective, method, zero, tmp_path), run_dir=str(folder.root),
                      callbacks=[resumed_steps])
    resumed.load_checkpoint(str(folder.checkpoints / "step-3"))
    resumed.train()
    resumed.close()
    assert resumed_steps.steps == full.steps[3:]  # bit for bit: losses and every metric

    records = [json.loads(line) for line in folder.events.read_text().splitlines()]
    train = [r for r in records if r.get("step") == 2 and "rewards/margins" in r]
    assert train and train[0]["rewards/margins"] == full.steps[1]["rewards/margins"]
    evals = [r for r in records if "eval/loss" in r]  # the objective on held-out rows, every 3 steps
    assert [r["step"] for r in evals] == [3, 6, 6] and "eval/rewards/chosen" in evals[0]
    assert evals[1] == {**evals[2], "time": evals[1]["time"]}  # the resumed run evaluates alike
    with open(folder.root / "train.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[1]["rewards/chosen"]) == pytest.approx(full.steps[1]["rewards/chosen"])


def test_preview_shows_the_answers_as_columns(tmp_path):
    from engine.preview import data_preview
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}],
                                "chosen": [{"role": "assistant", "content": "Hello!"}],
                                "rejected": [{"role": "assistant", "content": "go away"}]}) + "\n")
    assert data_preview(str(path))["pairs"] == [
        {"prompt": "user: hi", "chosen": "assistant: Hello!", "rejected": "assistant: go away"}]
