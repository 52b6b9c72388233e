"""GGUF from the live run (supervisor.client.Verbs.export_gguf: the terminal's `command RUN
export_gguf`, the web Checkpoints tab's "Export GGUF of the live model now", the notebook's
`Run.export_gguf`): the weights of a step boundary (a checkpoint saved there by every rank), a LoRA
run's adapter merged, converted by llama.cpp's converter while the run trains on. The file loads
in transformers with exactly the logits of that checkpoint's merged Hugging Face export (f32),
and llama.cpp itself generates transformers' greedy tokens from it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from contract.config.load import load_config  # noqa: E402
from contract.run_folder import read_events  # noqa: E402
from engine.checkpoint import gguf  # noqa: E402
from supervisor.client import RunClient  # noqa: E402
from supervisor.manager import RunManager  # noqa: E402
from test_gguf import PROMPTS, _sentencepiece, assert_llama_cpp_greedy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (gguf.converter_dir() / "convert_hf_to_gguf.py").is_file(),
    reason="llama.cpp's converter is installed by the set-up (python -m engine.checkpoint.gguf install)")]


def _llama(root: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    _sentencepiece(root / "tok")
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)).save_pretrained(root / "llama")
    tok.save_pretrained(str(root / "llama"))
    (root / "llama" / "tokenizer.model").write_bytes((root / "tok" / "tokenizer.model").read_bytes())
    return root / "llama"


def _steps(path: Path) -> list[int]:
    return [e["step"] for e in read_events(path) if e["type"] == "train"]


def _wait(what, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.2)


def test_the_live_models_gguf_is_its_step_boundarys_merged_weights(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    model = _llama(tmp_path / "model")
    cfg = load_config(overrides=[
        "run_name=live", "nproc=1", "max_steps=100000", "batch_size=4", "method=lora", "precision=fp32",
        "lr=0.05", f"model.path={model}", "eval.every_n_steps=0", "eval.at_end=false",
        "checkpoint.save_at_end=false", "logging.tensorboard=false", "control.enabled=true"])
    with RunManager(tmp_path / "runs") as manager:
        handle = manager.start(cfg)
        client = RunClient.connect(handle.folder.root, timeout=300)
        _wait(lambda: len(_steps(handle.folder.events)) >= 2)
        said = client.export_gguf(tmp_path / "gguf", "f32")
        # it went on training: the conversion ran beside it, in a process of its own
        saved = max(int(p.name.split("-")[1]) for p in (handle.folder.root / "checkpoints").glob("step-*"))
        _wait(lambda: max(_steps(handle.folder.events)) > saved)
        client.stop(save=False)
        client.close()
        assert handle.wait(timeout=120)
    assert f"{tmp_path / 'gguf' / gguf.GGUF_FILE}" in said and "LoRA merged into the base weights" in said, said
    checkpoint = handle.folder.root / "checkpoints" / f"step-{saved}"
    merged = subprocess.run([sys.executable, "-m", "engine.checkpoint", "export", str(checkpoint),
                             str(tmp_path / "merged"), "--merge-lora"], capture_output=True, text=True, timeout=600,
                            cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert merged.returncode == 0, merged.stderr
    source = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gguf"), gguf_file=gguf.GGUF_FILE,
                                                   dtype=torch.float32)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)(ids).logits
        assert torch.equal(got, source(ids).logits)
    assert (got - base).abs().max() > 1e-4  # the trained adapter is in the file
    assert_llama_cpp_greedy(tmp_path / "gguf" / gguf.GGUF_FILE, source, monkeypatch, "live LoRA")
