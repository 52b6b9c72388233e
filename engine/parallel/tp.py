"""Tensor parallelism through DeepSpeed AutoTP (training mode), for Hugging Face models.

How a run uses it (engine.assembly.model): the DeepSpeed config carries
`tensor_parallel: {autotp_size: N, vocab_parallel_lm_head: false}` and `deepspeed.initialize`
gets `mpu=deepspeed.utils.groups`, whose data x tensor mesh `engine.parallel.groups` created.
DeepSpeed then replaces the Hugging Face tp_plan's projections by sharded layers (q/k/v,
gate/up column-parallel, o/down row-parallel with an all-reduce) and sizes batches by the
data-parallel world (not all ranks).

Why the vocabulary stays whole: for a model with tied embeddings DeepSpeed would otherwise make
the embedding and the output head vocabulary-parallel, and the model's logits would then hold
only this rank's slice of the vocabulary: greedy chat would pick different tokens on each rank,
and a user's `loss_fn` would see partial logits. Keeping them replicated costs the memory of
one embedding per rank and gives every rank the full logits.

Every rank of a tensor group must see the same inputs (DeepSpeed checks the first forward);
the data layer shards by `dp_rank`, which the tensor ranks share.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.parallel import ds_config


def engine_mpu(tp_size: int):
    """The model-parallel unit handed to deepspeed.initialize: DeepSpeed's groups module under
    tensor parallelism (so ZeRO and the batch size use the data-parallel group), else None."""
    if tp_size <= 1:
        return None
    return ds_config.tensor_parallel_groups()


def full_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The whole model's weights gathered from the shards (collective): a state dict with the
    model's own names on global rank 0, None elsewhere."""
    return ds_config.consolidated_state_dict(engine)


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Copy whole (unsharded) weights into an AutoTP-sharded module (collective over the
    tensor group: every rank calls it with the same `state_dict`). Each replaced layer gathers
    its shards, takes the whole weight, and cuts its own shard again. Returns the missing keys."""
    missing, seen = [], set()
    for prefix, sub in module.named_modules():
        # a tied weight (lm_head = embed_tokens) is loaded once, under the name that comes first
        params = [(n, p) for n, p in sub.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in params)
        if not params:
            continue
        with ds_config.gathered_autotp_layer([p for _, p in params], sub):
            for name, param in params:
                key = f"{prefix}.{name}" if prefix else name
                if key not in state_dict:
                    missing.append(key)
                    continue
                source = state_dict[key]
                if tuple(source.shape) != tuple(param.shape):
                    raise ValueError(f"{key}: the file holds shape {tuple(source.shape)}, the model "
                                     f"{tuple(param.shape)}")
                param.data.copy_(source.to(param.dtype))
    return missing
