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

The head only at labelled positions (`train.logits_at_labels`, default on): a causal LM's loss
needs the logits of the positions that predict a label; prompt positions and padding need none.
With a wide vocabulary the head is much of a step's work (Qwen2-0.5B: about a third of the
forward's matrix products) and its fp32 logits much of its memory, so the head runs only where
it counts: transformers' `logits_to_keep` takes a boolean (batch, sequence) mask and returns the
kept positions' logits flattened to (kept, vocab). The loss is the model's own cross-entropy
(transformers' ForCausalLMLoss: fp32 logits, the token losses' sum over `num_items_in_batch`, or
their mean) over the same targets, so it equals the HF Trainer's within fp32 rounding (the head's
product over fewer rows may round differently in the last bit). It applies where the model's own
loss is that plain causal-LM cross-entropy and its forward slices by a mask (transformers'
`slice_logits_to_keep`: nearly every model of the library); elsewhere (a model of one's own, a
`loss_fn`, the prompt-learning PEFT methods, whose virtual tokens shift the positions) the model
computes every position's logits, as before.

The cross-entropy in chunks (`train.logits_chunk_rows`, default 1024): with more labelled rows
than that in a micro-batch, the head's input at those rows (taken by a pre-hook on the output
head, which then runs on no row) goes through the head a chunk of rows at a time, each chunk's
summed cross-entropy under `torch.utils.checkpoint` -- its logits are freed after the forward and
recomputed in the backward, so no more than one chunk's (rows, vocab) logits exist at once, at the
price of one more head product per chunk. The head is called as the module it is, so ZeRO-3's
gathering, a LoRA on the head and AutoTP's sharded head work as in the model's forward; under
ZeRO-3 each call gathers the head's weights collectively, so the ranks first agree on the number
of chunks (the most any rank needs; one all-reduce of a number per micro-batch) and a rank with
fewer labelled rows calls the head on empty chunks. The sum
over chunks equals the one cross-entropy within fp32 rounding. A model whose forward does
something to the logits after the head (Gemma's soft-capping, Cohere's and Granite's scaling:
`plain_head` reads the forward's source) keeps the unchunked path, which lets the model apply it.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.loss.loss_utils import ForCausalLMLoss

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


def label_positions(labels: torch.Tensor, shifted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, targets): the boolean mask of the positions whose logits predict a label, and those
    labels in the mask's row-major order. Shifted (a causal LM): position t predicts label t+1,
    so a row's last position predicts nothing."""
    if not shifted:
        keep = labels.ne(IGNORE_INDEX)
        return keep, labels[keep]
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:].ne(IGNORE_INDEX)
    return keep, labels[:, 1:][keep[:, :-1]]


@functools.lru_cache(maxsize=None)
def _slices_by_mask(model_class: type) -> bool:
    """Whether the class's forward takes `logits_to_keep` and slices with transformers'
    `slice_logits_to_keep` (the one that understands a boolean mask)."""
    forward = getattr(model_class, "forward", None)
    if forward is None or "logits_to_keep" not in inspect.signature(forward).parameters:
        return False
    return getattr(sys.modules.get(model_class.__module__), "slice_logits_to_keep", None) is not None


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model behind a DeepSpeed engine or a PEFT wrapper."""
    module = getattr(module, "module", module)  # a DeepSpeed engine's model
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def model_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """The model's logits; with `keep`, only the last `keep` positions' where the model can
    (transformers' `logits_to_keep`: the output head skips the rest), else every position's."""
    extra = {"logits_to_keep": keep} if keep and keeps_logits(hf_model(model)) else {}
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra).logits


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the Hugging Face model's forward takes `logits_to_keep`."""
    return _forward_takes_keep(type(model).forward)


@functools.lru_cache(maxsize=None)
def _forward_takes_keep(forward) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


def head_at_labels(module: torch.nn.Module) -> bool:
    """Whether the model behind `module` (a DeepSpeed engine, a PEFT wrapper or the model) can
    run its head at the labelled positions only, its own loss being the plain causal-LM one."""
    module = getattr(module, "module", module)  # a DeepSpeed engine's model
    peft = getattr(module, "active_peft_config", None)
    if peft is not None and getattr(peft, "is_prompt_learning", False):
        return False  # virtual tokens in front: the labels' positions are not the logits'
    module = hf_model(module)
    return getattr(module, "loss_function", None) is ForCausalLMLoss and _slices_by_mask(type(module))


@functools.lru_cache(maxsize=None)
def _plain_forward(model_class: type, head_name: str) -> bool:
    """Whether the class's forward returns the head's output as its logits untouched: one line
    `x = self.<head>(...)` and no later line of the forward assigning to x (soft-capping,
    scaling, a bias, a slice)."""
    try:
        lines = inspect.getsource(model_class.forward).splitlines()
    except (OSError, TypeError):
        return False
    calls = [i for i, line in enumerate(lines)
             if re.fullmatch(rf"\s*\w+ = self\.{re.escape(head_name)}\([^()]*\)\s*", line)]
    if len(calls) != 1:
        return False
    name = lines[calls[0]].split("=")[0].strip()
    changed = re.compile(rf"^\s*{name}\s*(=|\[|[-+*/]=)")
    for line in lines[calls[0] + 1:]:
        if line.strip().startswith("return"):
            return True  # its output (where `logits=logits` is a keyword, not a change)
        if changed.match(line):
            return False
    return True


def plain_head(module: torch.nn.Module) -> bool:
    """Whether the model's logits are its output head's output as they are (nothing applied
    after the head), so the head may be run by chunks outside its forward."""
    model = hf_model(module)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = next((n for n, m in model.named_children() if m is head), None) if head is not None else None
    return name is not None and _plain_forward(type(model), name)


def _chunk_sum(head: Callable, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def by_chunks(fn: Callable, head: Callable, hidden: torch.Tensor, targets: torch.Tensor, rows: int,
              chunks: int | None = None) -> list[torch.Tensor]:
    """`fn(head, hidden rows, target rows)` for `rows` rows at a time, each under
    torch.utils.checkpoint: a chunk's logits are freed after its forward and recomputed in the
    backward, so at most one chunk's logits exist at once. `chunks`: that many head calls (the
    last ones empty when the rows run out; default: as many as the rows need)."""
    count = chunks if chunks is not None else -(-targets.numel() // rows)
    return [checkpoint(fn, head, hidden[start:start + rows], targets[start:start + rows], use_reentrant=False)
            for start in range(0, count * rows, rows)]


def chunked_cross_entropy(head: Callable, hidden: torch.Tensor, targets: torch.Tensor, rows: int,
                          chunks: int | None = None) -> torch.Tensor:
    """The summed cross-entropy of `head(hidden)` (hidden: (n, hidden size)) against `targets`
    (n), `rows` rows at a time (`by_chunks`)."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for part in by_chunks(_chunk_sum, head, hidden, targets, rows, chunks):
        total = total + part
    return total


def head_chunks(module: torch.nn.Module, labelled: int, rows: int) -> int:
    """How many chunks of `rows` rows the head of the model behind `module` takes for `labelled`
    rows (`_chunk_count`: agreed among ZeRO-3's ranks), or 0 where it is not chunked (`rows` 0,
    or a model that does something to its logits after the head). The same on every rank."""
    if rows <= 0 or not plain_head(module):
        return 0
    return _chunk_count(hf_model(module).get_output_embeddings(), labelled, rows)


def _partition_group(head: torch.nn.Module):
    """The process group over which ZeRO-3 partitions the head's weights (each call of the head
    gathers them there, collectively), or None when they are whole on every rank."""
    return next((p.ds_process_group for p in head.parameters() if hasattr(p, "ds_id")), None)


def _chunk_count(head: torch.nn.Module, labelled: int, rows: int) -> int:
    """How many head calls the cross-entropy takes: as many as `labelled` rows need, or, where
    ZeRO-3 partitions the head, the most any rank of its group needs (every call is a collective
    gather, so every rank calls it as often; the others' last chunks are empty)."""
    count = -(-labelled // rows)
    group = _partition_group(head)
    if group is None or not dist.is_initialized():
        return count
    device = next(head.parameters()).device
    agreed = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return int(agreed.item())


def labelled_cross_entropy(head: Callable, hidden: torch.Tensor, targets: torch.Tensor,
                           chunk_rows: int = 0) -> torch.Tensor:
    """The summed cross-entropy of `head(hidden)` against `targets`: in chunks of `chunk_rows`
    when there are more rows than that (and `chunk_rows` > 0), else at once."""
    if 0 < chunk_rows < targets.numel():
        return chunked_cross_entropy(head, hidden, targets, chunk_rows)
    return _chunk_sum(head, hidden, targets)


def head_input(forward: Callable, inputs: dict, keep: torch.Tensor | int, module: torch.nn.Module) -> tuple:
    """(the output head's input at the kept positions, the head): the model's forward runs with
    `logits_to_keep=keep` and a pre-hook takes the head's input and hands the head no row."""
    head = hf_model(module).get_output_embeddings()
    taken: list[torch.Tensor] = []

    def take(_module, args):
        taken.append(args[0])
        return (args[0][:0], *args[1:])
    handle = head.register_forward_pre_hook(take)
    try:
        forward(**inputs, use_cache=False, logits_to_keep=keep)
    finally:
        handle.remove()
    if len(taken) != 1:
        raise RuntimeError(f"the output head ran {len(taken)} times in one forward; "
                           "set train.logits_chunk_rows=0 for this model")
    return taken[0], head


def labelled_loss(forward: Callable, batch: dict, window: Window = PER_MICRO_BATCH,
                  module: torch.nn.Module | None = None, chunk_rows: int = 0) -> torch.Tensor:
    """The micro-batch's causal-LM loss with the head run at the labelled positions only: the
    sum of its token losses over the window's label tokens, or without a count their mean (as
    the model's own: NaN for a micro-batch without a label, as in transformers). With more than
    `chunk_rows` (> 0) labelled rows and a plain head, the cross-entropy is taken in chunks."""
    keep, targets = label_positions(batch["labels"], window.shifted)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model = module if module is not None else forward
    chunks = head_chunks(model, targets.numel(), chunk_rows)  # type: ignore[arg-type]
    if chunks > 1:
        hidden, head = head_input(forward, inputs, keep, model)  # type: ignore[arg-type]
        total = chunked_cross_entropy(head, hidden, targets, chunk_rows, chunks)
    else:
        logits = forward(**inputs, use_cache=False, logits_to_keep=keep).logits  # (kept, vocab)
        total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets, reduction="sum")
    return total / (window.num_items if window.num_items is not None else targets.numel())


def model_loss(forward: Callable, batch: dict, device, loss_fn: Callable | None,
               window: Window = PER_MICRO_BATCH, module: torch.nn.Module | None = None,
               at_labels: bool = False, chunk_rows: int = 0) -> torch.Tensor:
    """Forward one micro-batch through `forward` (the engine, or the bare module) and return its
    loss for `window`: the model's own, or `loss_fn`'s. `module`: the model behind `forward`,
    asked whether it takes `num_items_in_batch` (default: `forward` itself). `at_labels`
    (`train.logits_at_labels`): the head only at the labelled positions, where the model allows;
    `chunk_rows` (`train.logits_chunk_rows`): its cross-entropy that many rows at a time."""
    # No KV cache in training: it is wasted work, and with one transformers treats a packed
    # row as one sequence (samples would attend to each other).
    batch = {k: v.to(device) for k, v in batch.items()}
    model = module if module is not None else forward
    if loss_fn is None and at_labels and head_at_labels(model):  # type: ignore[arg-type]
        return labelled_loss(forward, batch, window, model, chunk_rows)  # type: ignore[arg-type]
    if loss_fn is None:
        if window.num_items is None:
            return forward(**batch, use_cache=False).loss
        if accepts_num_items(model):  # type: ignore[arg-type]
            return forward(**batch, use_cache=False, num_items_in_batch=window.num_items).loss
        loss = forward(**batch, use_cache=False).loss  # a model of one's own: its mean, weighed
        return loss * (count_targets(batch["labels"], window.shifted) / window.num_items)
    model_inputs = {k: v for k, v in batch.items() if k != "labels"}
    outputs = forward(**model_inputs, use_cache=False)
    return custom_loss(loss_fn, batch, outputs, window)
