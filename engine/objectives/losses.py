"""The loss of one batch, and how one optimizer step weighs its micro-batches' losses.

The objective (`train.loss_average`, default "tokens") is the Hugging Face Trainer's since
transformers 4.46 (`average_tokens_across_devices`): the loss of a step is the sum of the token
losses over every micro-batch of the accumulation window on every data-parallel rank, divided by
the number of label tokens in that window, N (HF's `num_items_in_batch`). Its gradient does not
depend on how the samples are split into micro-batches, accumulation steps and ranks.

How it is done (as the HF Trainer does it): N is counted once per step (one all-reduce of one
integer over the data-parallel group); each micro-batch's loss is the sum of its token losses
divided by N -- the model computes it when given `num_items_in_batch=N` (transformers'
ForCausalLMLoss: reduction "sum", then / N); a `loss_fn` that names `num_items_in_batch` gets N
and is trusted to do the same; one that does not is taken to return a per-token mean and is
weighted by its own label tokens / N. DeepSpeed then averages gradients over the data-parallel
ranks (and, unless told otherwise, divides by the accumulation steps), so the step strategy
multiplies each micro-batch loss by `Window.scale` to undo exactly that.

"micro_batch" keeps the older objective: each micro-batch's mean loss, averaged
over the micro-batches and the ranks (every micro-batch weighs the same, whatever its tokens).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

IGNORE_INDEX = -100  # transformers' label value for "not a target"


@dataclass(frozen=True)
class Window:
    """How the micro-batches of one optimizer step are weighed.

    num_items: label tokens over the whole window on every data-parallel rank (HF's
        `num_items_in_batch`); None for the per-micro-batch mean.
    scale: the factor on each micro-batch loss before backward that undoes DeepSpeed's
        averaging over the data-parallel ranks (the step strategy multiplies in the
        accumulation steps where DeepSpeed divides by them).
    shifted: whether the loss predicts label t+1 from position t (causal LM: the first label of
        a row is never a target), which decides how the targets are counted.
    """
    num_items: int | None = None
    scale: float = 1.0
    shifted: bool = True


PER_MICRO_BATCH = Window()


def count_targets(labels: torch.Tensor, shifted: bool = True) -> int:
    """Label tokens the loss is taken over: labels other than -100, without each row's first
    when the loss shifts them (as the HF Trainer counts for causal LMs)."""
    if shifted:
        labels = labels[..., 1:]
    return int(labels.ne(IGNORE_INDEX).sum())


def token_window(micro_batches: list[dict], *, shifted: bool, dp_group, dp_size: int) -> Window:
    """The token-weighted window of one step: N counted over the micro-batches of every
    data-parallel rank (one all-reduce of one integer; collective over `dp_group`)."""
    if any("labels" not in b for b in micro_batches):
        # nothing to count (a custom loss without labels): each micro-batch weighs the same
        return PER_MICRO_BATCH
    local = sum(count_targets(b["labels"], shifted) for b in micro_batches)
    total = torch.tensor([local], dtype=torch.int64)
    if dp_size > 1:
        dist.all_reduce(total, group=dp_group)
    return Window(num_items=max(int(total[0]), 1), scale=float(dp_size), shifted=shifted)


def window_of(average: str, micro_batches: list[dict], *, shifted: bool, dp_group, dp_size: int) -> Window:
    """The window of the configured objective (`train.loss_average`)."""
    if average == "micro_batch":
        return PER_MICRO_BATCH
    return token_window(micro_batches, shifted=shifted, dp_group=dp_group, dp_size=dp_size)


def call_by_names(fn: Callable, batch: dict, outputs: Any, **extra: Any) -> torch.Tensor:
    """Call `fn` with the batch's, the model outputs' and `extra`'s fields its parameters name."""
    available = dict(batch)
    available.update({k: v for k, v in dict(outputs).items() if v is not None})
    available["batch"], available["outputs"] = batch, outputs
    available.update(extra)
    params = inspect.signature(fn).parameters
    missing = [p for p in params if p not in available and params[p].default is inspect.Parameter.empty
               and params[p].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    if missing:
        raise TypeError(f"loss_fn wants {missing}, which neither the batch ({sorted(batch)}) "
                        f"nor the model outputs ({sorted(dict(outputs))}) provide")
    return fn(**{p: available[p] for p in params if p in available})


def custom_loss(loss_fn: Callable, batch: dict, outputs: Any, window: Window = PER_MICRO_BATCH) -> torch.Tensor:
    """A user's `loss_fn` on one micro-batch, weighed for `window` (see the module docstring)."""
    names_count = "num_items_in_batch" in inspect.signature(loss_fn).parameters
    loss = call_by_names(loss_fn, batch, outputs, num_items_in_batch=window.num_items)
    if window.num_items is None or names_count:
        return loss
    # a per-token mean: weighed by this micro-batch's share of the window's targets
    return loss * (count_targets(batch["labels"], window.shifted) / window.num_items)


def accepts_num_items(module: torch.nn.Module) -> bool:
    """Whether the model's forward takes `num_items_in_batch` (the HF Trainer's test: the
    model's `accepts_loss_kwargs`, else a `**kwargs` in its forward)."""
    module = getattr(module, "module", module)  # a DeepSpeed engine's model
    if hasattr(module, "get_base_model"):  # a PeftModel passes its kwargs to the base model
        module = module.get_base_model()
    if hasattr(module, "accepts_loss_kwargs"):
        return bool(module.accepts_loss_kwargs)
    params = inspect.signature(module.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD or p.name == "num_items_in_batch" for p in params)


def model_loss(forward: Callable, batch: dict, device, loss_fn: Callable | None,
               window: Window = PER_MICRO_BATCH, module: torch.nn.Module | None = None) -> torch.Tensor:
    """Forward one micro-batch through `forward` (the engine, or the bare module) and return its
    loss for `window`: the model's own, or `loss_fn`'s. `module`: the model behind `forward`,
    asked whether it takes `num_items_in_batch` (default: `forward` itself)."""
    # No KV cache in training: it is wasted work, and with one transformers treats a packed
    # row as one sequence (samples would attend to each other).
    batch = {k: v.to(device) for k, v in batch.items()}
    if loss_fn is None:
        if window.num_items is None:
            return forward(**batch, use_cache=False).loss
        if accepts_num_items(module if module is not None else forward):  # type: ignore[arg-type]
            return forward(**batch, use_cache=False, num_items_in_batch=window.num_items).loss
        loss = forward(**batch, use_cache=False).loss  # a model of one's own: its mean, weighed
        return loss * (count_targets(batch["labels"], window.shifted) / window.num_items)
    model_inputs = {k: v for k, v in batch.items() if k != "labels"}
    outputs = forward(**model_inputs, use_cache=False)
    return custom_loss(loss_fn, batch, outputs, window)
