"""The architecture matrix's tensor-parallel cell (tests/test_architectures.py): one DeepSpeed
launch of 2 ranks, tp=2 (DeepSpeed AutoTP), for each architecture the test found accepted by the
pre-flight check, all in the same process group. Full fine-tuning under ZeRO-2 with dp = 1 and
micro-batch 8: the same 8 rows per step as architectures_zero.py's ZeRO-2 cell (2 ranks x 4), so
the test compares the two loss sequences step for step; a streamed chat at step CHAT_STEP; the
number of parameters this rank holds (fewer than the model's: the projections are split). Every
rank reports one RESULT line per architecture.

    deepspeed --num_gpus 2 tests/scripts/architectures_tp.py --work WORK --archs llama qwen2 ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from architectures import FULL_LR, chat, train  # noqa: E402
from architectures_zero import CHAT_STEP, STEPS  # noqa: E402
from dist_utils import report  # noqa: E402


def one(folder: Path) -> dict:
    chats: list[dict] = []
    started = time.monotonic()
    trainer, losses = train(folder, "full", FULL_LR, "nproc=2", "tp=2", "zero_stage=2", "batch_size=8",
                            steps=STEPS, name="tp2_full", at_step={CHAT_STEP: lambda t: chats.append(chat(t))})
    result = {"losses": losses, "chat": chats[0] if chats else None, "tp_size": trainer.env.tp_size,
              "dp_size": trainer.env.dp_size,  # this rank's share of the weights (AutoTP split them)
              "local_parameters": sum(p.numel() for p in trainer.engine.module.parameters())}
    trainer.close()
    return {**result, "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--archs", nargs="+", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    rank = int(os.environ.get("RANK", a.local_rank))
    for arch in a.archs:
        try:
            result = one(Path(a.work) / arch)
        except Exception:  # the same error on both ranks (AutoTP refusing a layer): the next one goes on
            result = {"error": traceback.format_exc()[-2500:]}
        report(arch=arch, rank=rank, **result)


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
