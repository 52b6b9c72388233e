"""The loss of one batch: the model's own, or a user's `loss_fn` called with the fields it names."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch


def call_by_names(fn: Callable, batch: dict, outputs: Any) -> torch.Tensor:
    """Call `fn` with the batch's and the model outputs' fields its parameters name."""
    available = dict(batch)
    available.update({k: v for k, v in dict(outputs).items() if v is not None})
    available["batch"], available["outputs"] = batch, outputs
    params = inspect.signature(fn).parameters
    missing = [p for p in params if p not in available and params[p].default is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"loss_fn wants {missing}, which neither the batch ({sorted(batch)}) "
                        f"nor the model outputs ({sorted(dict(outputs))}) provide")
    return fn(**{p: available[p] for p in params if p in available})


def model_loss(forward: Callable, batch: dict, device, loss_fn: Callable | None) -> torch.Tensor:
    """Forward one micro-batch through `forward` (the engine, or the bare module) and return its
    loss: the model's own, or `loss_fn`'s."""
    # No KV cache in training: it is wasted work, and with one transformers treats a packed
    # row as one sequence (samples would attend to each other).
    batch = {k: v.to(device) for k, v in batch.items()}
    if loss_fn is None:
        return forward(**batch, use_cache=False).loss
    model_inputs = {k: v for k, v in batch.items() if k != "labels"}
    outputs = forward(**model_inputs, use_cache=False)
    return call_by_names(loss_fn, batch, outputs)
