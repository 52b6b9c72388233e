"""The learning-rate schedules `optim.scheduler` names: transformers' constant-with-warmup, linear
and cosine schedules (transformers/optimization.py), as `LambdaLR` factors with the same formulas.

Why not `transformers.get_scheduler`: importing `transformers.optimization` imports
`transformers.trainer_utils`, which imports peft, and peft imports bitsandbytes (whose import
runs torch.compile: dynamo and inductor) and transformers' bloom model: ~4 s of every rank's
start, in runs that use neither PEFT nor quantization, for three one-line formulas.
tests/test_import_cost.py pins these factors to transformers' own, exactly, step by step.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("constant", "linear", "cosine")


def _constant_with_warmup(step: int, *, warmup: int) -> float:
    if step < warmup:
        return float(step) / float(max(1.0, warmup))
    return 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int, cycles: float = 0.5) -> float:
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(cycles) * 2.0 * progress)))


def lr_schedule(name: str, optimizer: torch.optim.Optimizer, warmup: int, total: int) -> LambdaLR:
    """`optimizer`'s schedule `name` (one of SCHEDULES): a linear warmup over `warmup` steps, then
    constant, linear decay to 0 at `total`, or a half cosine to 0 at `total`."""
    if name == "constant":
        factor = partial(_constant_with_warmup, warmup=warmup)
    elif name == "linear":
        factor = partial(_linear, warmup=warmup, total=total)
    elif name == "cosine":
        factor = partial(_cosine, warmup=warmup, total=total)
    else:
        raise ValueError(f"optim.scheduler: {name!r} is not one of {', '.join(SCHEDULES)}")
    return LambdaLR(optimizer, factor)
