"""Run by tests/test_ds_config.py on 2 ranks: configs built by engine.parallel.ds_config start real
DeepSpeed engines (ZeRO 0-3, torch and DeepSpeed optimizers, offload) and train a tiny Llama.

Each case prints one RESULT line per rank: the losses, and under ZeRO-3 the parameter elements
this rank holds right after construction.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import deepspeed
import torch
from transformers.integrations import is_deepspeed_zero3_enabled

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import report  # noqa: E402

from contract.config.load import load_config  # noqa: E402
from contract.deepspeed_config import build_ds_config
from engine.parallel.ds_config import zero3_init  # noqa: E402

HIDDEN, VOCAB, SEQ, STEPS = 64, 128, 32, 6
CASES = {  # name: (run-config overrides, user DeepSpeed config)
    "zero0": (["zero_stage=0"], {}),
    "zero1": (["zero_stage=1"], {}),
    "zero2_offload": (["zero_stage=2", "parallel.offload_optimizer=true"], {}),
    "zero3": (["zero_stage=3"], {"zero_optimization": {"reduce_bucket_size": "auto",
                                                       "stage3_prefetch_bucket_size": "auto",
                                                       "stage3_param_persistence_threshold": "auto"}}),
    "zero3_ds_optimizer": (["zero_stage=3"],
                           {"optimizer": {"type": "auto", "params": {"lr": "auto", "torch_adam": True}},
                            "scheduler": {"type": "auto"}}),
}


def tiny_llama():
    """Built as engine.model.loading builds it: through from_config, which under ZeRO-3 initialises the
    weights on the shards the Hugging Face way (calling the class directly would not)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                         initializer_range=0.02)
    return AutoModelForCausalLM.from_config(config)


def init_std(model) -> float:
    """Std of one weight matrix, gathered whole when ZeRO-3 partitioned it."""
    weight = model.model.layers[0].self_attn.q_proj.weight
    with deepspeed.zero.GatheredParameters([weight]):
        return weight.detach().float().std().item()


def run_case(name: str, rank: int) -> None:
    overrides, user = CASES[name]
    cfg = load_config(overrides=["nproc=2", "precision=fp32", "batch_size=2", "lr=0.01", "max_steps=6",
                                 "optim.warmup_steps=1", "optim.scheduler=constant", *overrides],
                      data={"parallel": {"deepspeed": user}})
    setup = build_ds_config(cfg, world_size=2, dp_size=2, total_steps=STEPS, warmup_steps=1,
                            hidden_size=HIDDEN, precision="fp32")
    torch.manual_seed(0)
    with zero3_init(setup.config):
        model = tiny_llama()
    held = sum(p.ds_tensor.numel() for p in model.parameters() if hasattr(p, "ds_tensor"))
    full = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())  # 0 for partitioned placeholders
    std = init_std(model)
    optimizer = None if setup.ds_optimizer else torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=setup.config,
                                      model_parameters=model.parameters() if setup.ds_optimizer else None)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own fixed batch
    ids = torch.randint(0, VOCAB, (cfg.train.micro_batch_size, SEQ), generator=gen)
    losses = []
    for _ in range(STEPS):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report(case=name, rank=rank, losses=losses, held=held, full=full, whole=whole,
           std=std, zero3_mode=is_deepspeed_zero3_enabled(),
           stage=setup.zero_stage, warnings=setup.warnings, ds_optimizer=setup.ds_optimizer,
           optimizer=type(engine.optimizer).__name__)
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    for name in args.cases:
        run_case(name, torch.distributed.get_rank())
        torch.distributed.barrier()


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
