"""The embedded default's GRPO variant (`./launch.sh train objective=grpo`, docs/rewards.md): its
own preset (small groups of short answers), and a start from the default task's SFT model,
trained first in the same output folder and kept for the next GRPO run (supervisor.warm_start).
The reward curve it gives is bench/bench_grpo_default.py's (docs/rewards.md records it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.args import resolve_args
from contract.config.load import load_config
from contract.presets import GRPO_DEFAULT, WARM_START_STEPS
from contract.run_folder import EventLog, read_events
from supervisor import warm_start

REPO = Path(__file__).resolve().parents[1]


def test_the_grpo_variant_has_its_own_preset_and_asks_for_the_sft_model(tmp_path):
    grpo = resolve_args(["objective=grpo", f"output_dir={tmp_path}"])
    cfg = grpo.config
    assert (cfg.train.micro_batch_size, cfg.grpo.num_generations, cfg.grpo.max_completion_length) == (
        GRPO_DEFAULT["train"]["micro_batch_size"], 8, 16)
    assert "from the preset" in grpo.provenance() and "grpo.max_completion_length=16" in grpo.provenance()
    assert warm_start.wanted(cfg)
    assert resolve_args([]).config.train.micro_batch_size == 64  # SFT keeps its own preset
    with_model = resolve_args(["objective=grpo"]).config
    with_model.model.path = str(tmp_path)
    assert not warm_start.wanted(with_model)
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    assert not warm_start.wanted(resolve_args(["objective=grpo", f"data.train={tmp_path / 'p.jsonl'}"]).config)
    assert not warm_start.wanted(resolve_args(["objective=dpo"]).config)
    sft = warm_start.sft_config(cfg)
    assert (sft.preference.objective, sft.train.max_steps, sft.logging.run_name) == ("sft", WARM_START_STEPS, "default-sft")
    assert sft.checkpoint.save_at_end and sft.train.micro_batch_size == 64 and sft.logging.output_dir == str(tmp_path)


def _sft_folder(root: Path, name: str, state: str) -> Path:
    folder = root / name
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    log = EventLog(folder / "events.jsonl")
    log.emit({"type": "state", "state": state})
    log.close()
    return folder / "model"


def test_only_a_finished_sft_runs_model_is_taken(tmp_path):
    assert warm_start.ready(tmp_path) is None
    _sft_folder(tmp_path, "default-sft", "failed")
    assert warm_start.ready(tmp_path) is None
    finished = _sft_folder(tmp_path, "default-sft-2", "finished")
    assert warm_start.ready(tmp_path) == finished


@pytest.mark.slow  # a short SFT run of the default task (1 rank), then 2 GRPO steps from its model
def test_train_objective_grpo_trains_the_sft_model_first_then_grpo_from_it(tmp_path):
    """The terminal's path end to end, with 30 SFT steps instead of 500 (how well 500 do, and the
    reward curve after them: bench/bench_grpo_default.py, docs/rewards.md)."""
    out = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "app.cli", "train", "objective=grpo", f"output_dir={out}",
                           "run_name=g", "max_steps=2", "eval.at_end=false", "checkpoint.save_at_end=false"],
                          cwd=REPO, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", warm_start.STEPS_ENV: "30"},
                          capture_output=True, text=True, timeout=1500)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    model = out / "default-sft" / "model"
    assert "training it first, 30 steps" in text and f"GRPO from model.path={model}" in text, text
    sft = [e for e in read_events(out / "default-sft" / "events.jsonl") if e["type"] in ("train", "eval")]
    assert [e["step"] for e in sft if e["type"] == "train"] == list(range(1, 31))
    assert any(e["type"] == "eval" and "eval/exact_match" in e for e in sft)  # evaluated at its end
    assert load_config(out / "g" / "config.yaml").model.path == str(model)
    steps = [e for e in read_events(out / "g" / "events.jsonl") if e["type"] == "train"]
    assert [e["step"] for e in steps] == [1, 2] and all("reward" in e for e in steps), steps
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
