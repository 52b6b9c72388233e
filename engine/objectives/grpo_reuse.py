"""The samples of a GRPO step, kept for the `grpo.num_iterations` optimizer steps that train them
(docs/rewards.md). As TRL counts: every optimizer step is a step; answers are sampled on the
steps whose number (from 0) is a multiple of num_iterations, and the steps between train the same
samples again, with importance ratios against the log-probabilities of the policy that sampled
them (TRL's `old_per_token_logps`; the first iteration's ratio is 1, as with num_iterations 1).

The batch sampler deals each step's prompts num_iterations times in a row
(engine.data.repeat_sampler), so a reusing step is handed the very prompts its samples answer,
which `reused` checks. A checkpoint (or snapshot) taken between the iterations of a batch keeps
every data-parallel rank's samples (`gather_batches`, stored with the callbacks' states), so a
resume or a rewind there trains exactly what the uninterrupted run trains."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class SampleBatch:
    """One step's samples on this rank and what the steps reusing them need."""
    step: int                                   # the global step (from 0) that sampled them
    failed: bool = False                        # a reward function failed: the batch trains nothing
    samples: list[Any] = field(default_factory=list)  # engine.objectives.grpo_step.Samples, per micro-batch
    advantages: torch.Tensor | None = None      # this rank's, in sample order
    step_tokens: float = 0.0                    # answer tokens of the step on every rank (dapo)
    metrics: dict[str, float] = field(default_factory=dict)  # rewards and lengths, logged when sampled
    old_logps: list[torch.Tensor] | None = None  # the sampling policy's, per micro-batch (after iteration 1)


def reused(batch: SampleBatch | None, sampled_at: int, micro_batches: list[dict]) -> SampleBatch:
    """The batch a reusing step trains: the one sampled at step `sampled_at`, whose prompts are
    this step's (`micro_batches`, dealt again by the repeat sampler). RuntimeError otherwise."""
    if batch is None or batch.step != sampled_at:
        have = "none" if batch is None else f"those of step {batch.step}"
        raise RuntimeError(f"grpo.num_iterations: this step trains the samples of step {sampled_at} again, "
                           f"but the step holds {have} (a checkpoint without its samples?)")
    if not batch.failed:
        given = [int(i) for b in micro_batches for i in b["index"].tolist()]
        g = len(batch.samples[0].indices) // max(1, len(micro_batches[0]["index"])) if batch.samples else 1
        kept = [i for s in batch.samples for i in s.indices[::g]]
        if given != kept:
            raise RuntimeError(f"grpo.num_iterations: the step's prompts {given} are not those its samples "
                               f"answer ({kept}): the data order does not repeat the step's prompts")
    return batch


def gather_batches(batch: SampleBatch | None, env) -> list[SampleBatch | None]:
    """Every data-parallel rank's batch, by data-parallel rank (collective over the data-parallel
    group; tensor-parallel peers hold the same samples)."""
    if env.dp_size == 1 or not dist.is_initialized():
        return [batch]
    every: list[Any] = [None] * env.dp_size
    dist.all_gather_object(every, batch, group=env.dp_group)
    return every
