"""The architecture matrix on 2 ranks (tests/test_architectures.py), one DeepSpeed launch, every
architecture in the same process group. For each folder WORK/ARCH (written by the test):

- ZeRO-2, full fine-tuning: STEPS steps, a streamed chat at step CHAT_STEP, then `save_model`
  to WORK/ARCH/full and the engine's logits on IDS;
- ZeRO-3, LoRA: STEPS steps, a streamed chat at step CHAT_STEP (every rank gathers the shards
  for each token), then `save_model` (the adapter, PEFT layout) to WORK/ARCH/adapter,
  `export_merged` (base + LoRA, one plain model) to WORK/ARCH/merged and the engine's logits.

Rank 0 writes WORK/ARCH/logits.pt ({"full": ..., "lora": ...}); every rank reports one RESULT
line per architecture with its losses and chats.

    deepspeed --num_gpus 2 tests/scripts/architectures_zero.py --work WORK --archs gpt2 qwen2 ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from architectures import FULL_LR, LORA_LR, chat, engine_logits, train  # noqa: E402
from dist_utils import report  # noqa: E402

STEPS, CHAT_STEP = 8, 2  # 2 ranks x micro-batch 4: 4 steps pass over the 32 rows once, 8 twice


def full_zero2(folder: Path) -> dict:
    chats: list[dict] = []
    trainer, losses = train(folder, "full", FULL_LR, "nproc=2", "zero_stage=2", steps=STEPS, name="zero2_full",
                            at_step={CHAT_STEP: lambda t: chats.append(chat(t))})
    trainer.save_model(str(folder / "full"))
    logits = engine_logits(trainer)
    trainer.close()
    return {"losses": losses, "chat": chats[0] if chats else None, "logits": logits}


def lora_zero3(folder: Path) -> dict:
    from engine.checkpoint import export_merged
    chats: list[dict] = []
    trainer, losses = train(folder, "lora", LORA_LR, "nproc=2", "zero_stage=3", steps=STEPS, name="zero3_lora",
                            at_step={CHAT_STEP: lambda t: chats.append(chat(t))})
    trainer.save_model(str(folder / "adapter"))
    export_merged(trainer.ctx, str(folder / "merged"))
    logits = engine_logits(trainer)
    trainer.close()
    return {"losses": losses, "chat": chats[0] if chats else None, "logits": logits}


def one(work: Path, arch: str, rank: int) -> dict:
    folder, started = work / arch, time.monotonic()
    full = full_zero2(folder)
    lora = lora_zero3(folder)
    if rank == 0:
        torch.save({"full": full.pop("logits"), "lora": lora.pop("logits")}, folder / "logits.pt")
    full.pop("logits", None)
    lora.pop("logits", None)
    return {"full": full, "lora": lora, "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--archs", nargs="+", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    rank = int(os.environ.get("RANK", a.local_rank))  # the launcher's, known before the group exists
    for arch in a.archs:
        try:
            result = one(Path(a.work), arch, rank)
        except Exception:  # the same error on both ranks (a config or shape problem): the next one goes on
            result = {"error": traceback.format_exc()[-2500:]}
        report(arch=arch, rank=rank, **result)


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
