"""`python -m engine.checkpoint export` (what the web app's Export / Merge buttons run): a training
checkpoint written by 2 ranks becomes a Hugging Face folder that transformers loads and that
gives the trained model's logits; a LoRA checkpoint merged gives base + adapter's logits; every
wrong source says what is wrong and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import REPO_ROOT, default_precision, tail

pytestmark = pytest.mark.slow  # a browser, a kernel or engine processes: the slow tier

PROMPT = "sort: dcba"


def train(out: Path, name: str, *overrides: str) -> Path:
    cmd = [sys.executable, "-m", "app.cli", "train", "nproc=2", "max_steps=3", "batch_size=8",
           "checkpoint.every_n_steps=3", "eval.every_n_steps=0", f"output_dir={out}", f"run_name={name}",
           "logging.progress_bar=false", "logging.tensorboard=false", *overrides]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, tail(done.stdout + done.stderr)
    return out / name


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.checkpoint", "export", *map(str, args)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.fixture(scope="module")
def z3_run(tmp_path_factory) -> Path:
    """One ZeRO-3 run for the command line's and the web backend's export (a 2-rank start costs
    far more than its 3 steps); a ZeRO-2 checkpoint is exported by the LoRA test below."""
    return train(tmp_path_factory.mktemp("z3"), "z3", "zero_stage=3")


@pytest.mark.timeout(1200)
def test_zero3_checkpoint_exports_the_trained_model(tmp_path, z3_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run = z3_run
    target = tmp_path / "exported"
    done = export(run / "checkpoints" / "step-3", target)
    assert done.returncode == 0, done.stderr
    assert "step 3" in done.stdout and (target / "model.safetensors").exists()
    exported = AutoModelForCausalLM.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    # the run's own final model (saved from the engine after step 3) is the reference
    final = AutoModelForCausalLM.from_pretrained(run / "model")
    run_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[default_precision()]
    assert exported.dtype == final.dtype == run_dtype  # the run's precision (`auto` on this machine)
    torch.testing.assert_close(logits(exported, tokenizer), logits(final, tokenizer), rtol=0, atol=0)

    again = export(run / "checkpoints" / "step-3", target)  # never over a folder with files
    assert again.returncode == 2 and "target:" in again.stderr and "not empty" in again.stderr
    plain = export(run / "checkpoints" / "step-3", tmp_path / "merged", "--merge-lora")
    assert plain.returncode == 2 and "no adapter to merge" in plain.stderr
    assert not (tmp_path / "merged").exists()


@pytest.mark.timeout(1200)
def test_web_backend_exports_into_a_folder_relative_to_where_the_app_runs(tmp_path, monkeypatch, z3_run):
    """The Checkpoints tab's Export button: backend -> `python -m engine.checkpoint export`."""
    from transformers import AutoModelForCausalLM

    from app.session import SessionError
    from app.web.backend import Backend
    run = z3_run
    backend = Backend(tmp_path)
    monkeypatch.chdir(tmp_path)
    message = backend.store.export(str(run / "checkpoints" / "step-3"), "exports/mine")
    assert str(tmp_path / "exports" / "mine") in message
    AutoModelForCausalLM.from_pretrained(tmp_path / "exports" / "mine")
    with pytest.raises(SessionError, match="no adapter to merge"):  # the CLI's own reason, not a traceback
        backend.store.export(str(run / "checkpoints" / "step-3"), "exports/merged", merge_lora=True)


def test_lora_checkpoint_merged_equals_base_plus_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.data.default_task import default_root, ensure_default_assets
    from engine.model.loading import build_model
    run = train(tmp_path, "lora", "zero_stage=2", "method=lora", "precision=fp32", "lr=0.01")
    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    done = export(run / "checkpoints" / "step-3", merged_dir, "--merge-lora")
    assert done.returncode == 0, done.stderr
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    # reference: the base built as the run built it (same folder, same seed) + the run's adapter
    base = build_model(ensure_default_assets(default_root()).model_dir, seed=42, precision="fp32")
    reference = PeftModel.from_pretrained(base, run / "model")
    torch.testing.assert_close(logits(merged, tokenizer), logits(reference, tokenizer), rtol=1e-4, atol=1e-4)
    untouched = build_model(ensure_default_assets(default_root()).model_dir, seed=42, precision="fp32")
    assert not torch.allclose(logits(merged, tokenizer), logits(untouched, tokenizer))  # the adapter counts

    kept = export(run / "checkpoints" / "step-3", adapter_dir)  # without merging: PEFT's own layout
    assert kept.returncode == 0, kept.stderr
    assert (adapter_dir / "adapter_config.json").exists() and (adapter_dir / "adapter_model.safetensors").exists()

    # the run's adapter folder alone cannot be exported: its base (the default) has no weights
    alone = export(run / "model", tmp_path / "x", "--merge-lora")
    assert alone.returncode == 2 and "with weights" in alone.stderr and "training checkpoint" in alone.stderr


@pytest.mark.parametrize("case", ["missing", "not-a-model", "unfinished", "damaged"])
def test_bad_sources_name_the_problem(tmp_path, case):
    source = tmp_path / "src"
    expected = {"missing": "no such folder", "not-a-model": "neither a training checkpoint",
                "unfinished": "no completion marker", "damaged": "damaged"}[case]
    if case != "missing":
        source.mkdir()
        (source / "notes.txt").write_text("hello")
    if case in ("unfinished", "damaged"):
        (source / "trainer_state.json").write_text("{}")
    if case == "damaged":  # a complete marker whose manifest no longer matches the file
        from engine.checkpoint import atomic
        with atomic.writing(str(source), kind="training") as w:
            (w.local / "trainer_state.json").write_text("{}")
            w.claim("trainer_state.json")
        (source / "trainer_state.json").write_text('{"changed": 1}')
    done = export(source, tmp_path / "out")
    assert done.returncode == 2 and expected in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
