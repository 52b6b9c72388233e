"""LoRA on a quantized base (QLoRA; bitsandbytes on the CPU): a 4-bit and an 8-bit run on one
rank, in this process, train (the loss falls by a clear margin), chat with the live weights,
resume from a checkpoint bit for bit, and save an adapter that reloads onto the quantized base
with the engine's logits; the merged export is a plain model in the compute dtype. The
combinations that cannot carry a quantized base are refused before launch, naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from contract.config.load import load_config
from contract.config.schema import ConfigError
from engine.callbacks import Callback

STEPS = 8
SAVE_AT = 4


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    from conftest import make_tiny_tokenizer
    from engine.data.default_task import make_examples
    work = tmp_path_factory.mktemp("qlora")
    tok = make_tiny_tokenizer()
    torch.manual_seed(0)
    # hidden 64 (bitsandbytes' 4-bit blocks are 64 values); weights drawn wide (std 0.2) so that the
    # base's activations are not near zero and a small adapter moves its output within a few steps
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    rows = make_examples(64, seed=0)
    (work / "train.jsonl").write_text("".join(json.dumps({"input": r["input"], "output": r["output"]}) + "\n"
                                              for r in rows))
    return work


def _config(work: Path, quantization: str, out: Path, *extra: str):
    return load_config(overrides=[
        f"model.path={work / 'model'}", f"data.train={work / 'train.jsonl'}", f"model.quantization={quantization}",
        "method=lora", "method.lora_r=8", "zero_stage=0", f"max_steps={STEPS}", "batch_size=8", "lr=6e-2",
        "precision=fp32", "data.batching=random", "eval.at_end=false", "checkpoint.save_at_end=false",
        "control.enabled=false", "logging.tensorboard=false", f"output_dir={out}", "run_name=run", *extra])


class Losses(Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, loss):
        self.losses.append(loss)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_lora_on_a_quantized_base(inputs, tmp_path, quantization):
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from engine.checkpoint.adapters import export_merged
    from engine.generation.generate import generate
    from engine.model.loading import build_model, quantization_config
    from engine.trainer import Trainer

    layer = bnb.nn.Linear4bit if quantization == "4bit" else bnb.nn.Linear8bitLt
    full = Losses()
    trainer = Trainer(config=_config(inputs, quantization, tmp_path, f"checkpoint.every_n_steps={SAVE_AT}"),
                      callbacks=[full])
    base = trainer.engine.module.get_base_model()
    assert isinstance(base.model.layers[0].self_attn.q_proj.base_layer, layer)
    trainer.train()
    assert len(full.losses) == STEPS
    assert full.losses[-1] < 0.85 * full.losses[0], full.losses  # it learns
    new_ids: list[list[int]] = []  # chat with the live weights (greedy)
    answer = generate(trainer.ctx, ["12+3="], max_new_tokens=4, on_ids=new_ids.extend)
    assert isinstance(answer[0], str) and len(new_ids[0]) >= 1
    ids = torch.tensor([[1, 20, 21, 22, 23, 24, 25]])
    trainer.engine.eval()
    live = _logits(trainer.engine.module, ids)
    trainer.save_peft(str(tmp_path / "adapter"))
    export_merged(trainer.ctx, str(tmp_path / "merged"))
    folder = trainer.folder
    trainer.close()

    # the adapter reloads onto the quantized base (built as the run built it) with equal logits
    cfg = _config(inputs, quantization, tmp_path)
    quantized = build_model(inputs / "model", seed=cfg.train.seed, precision="fp32",
                            quantization=quantization_config(cfg.model, "fp32"))
    reloaded = PeftModel.from_pretrained(quantized, str(tmp_path / "adapter")).eval()
    assert torch.equal(_logits(reloaded, ids), live)

    # the merged export: a plain fp32 model (dequantized base + LoRA) that answers as the run did
    merged_folder = tmp_path / "merged"
    assert "quantization_config" not in json.loads((merged_folder / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(str(merged_folder)).eval()
    assert all(t.dtype == torch.float32 for t in merged.state_dict().values())
    gap = (_logits(merged, ids) - live).abs().max().item() / live.abs().max().item()
    # relative to the logits' scale: bitsandbytes' CPU kernels do not compute in plain fp32 products
    # of the dequantized weights, and 8-bit's int8 matmul also rounds the inputs
    assert gap < (1e-2 if quantization == "4bit" else 5e-2), gap

    resumed_losses = Losses()  # exact resume: the same losses, bit for bit
    resumed = Trainer(config=cfg, run_dir=str(folder.root), callbacks=[resumed_losses])
    resumed.load_checkpoint(str(folder.checkpoints / f"step-{SAVE_AT}"))
    resumed.train()
    resumed.close()
    assert resumed_losses.losses == full.losses[SAVE_AT:]


@pytest.mark.parametrize("overrides, field, says", [
    (["method=full"], "model.quantization", "frozen integers"),
    (["method=lomo"], "model.quantization", "frozen integers"),
    (["method=adalomo"], "model.quantization", "frozen integers"),
    (["method=lora", "zero_stage=3"], "model.quantization", "ZeRO-3"),
    (["method=lora", "nproc=2", "tp=2"], "model.quantization", "tensor and pipeline"),
    (["method=lora", "nproc=2", "pp=2"], "model.quantization", "tensor and pipeline"),
])
@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_unsupported_combinations_are_refused(overrides, field, says, quantization):
    with pytest.raises(ConfigError) as refused:
        load_config(overrides=[f"model.quantization={quantization}", *overrides])
    assert any(key == field and says in msg for key, msg in refused.value.problems), refused.value.problems
    load_config(overrides=[f"model.quantization={quantization}", "method=lora"])  # the supported one


@pytest.mark.slow
def test_4bit_lora_on_two_ranks_under_zero2(tmp_path):
    from dist_utils import SCRIPTS, parse_results, run_deepspeed
    proc = run_deepspeed(SCRIPTS / "qlora_zero2.py", nproc=2, args=("--out", str(tmp_path)), timeout=900)
    results = sorted(parse_results(proc), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    first, second = results
    assert first["layer"] == "Linear4bit"
    assert first["losses"] == second["losses"]  # the step's loss, the same on both ranks
    losses = first["losses"]  # the embedded default model's small weights learn slowly: 5% in 12 steps
    assert sum(losses[-3:]) < 0.95 * sum(losses[:3]), losses
    assert first["new_ids"] == second["new_ids"] and len(first["new_ids"]) >= 1  # chat is collective
