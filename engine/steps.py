"""Step strategies: how one optimizer step is carried out, chosen once at assembly.

A strategy is called with the trainer and the micro-batches of one optimizer step and returns
(mean loss over the micro-batches as a float tensor, real tokens trained on this rank). The
run's method object picks it (engine.methods): the fused LOMO / AdaLomo step
(engine.lomo.FusedStep), or else the layout's, which is this engine step or the pipeline
schedule (engine.parallel.pipeline.PipelineStep). A user's `train_fn` has the same signature.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.data import count_tokens


class StepStrategy(Protocol):
    def __call__(self, trainer, micro_batches: list[dict]) -> tuple[torch.Tensor, int]: ...


class EngineStep:
    """The DeepSpeed engine's own forward / backward / step; it accumulates across micro-batches
    and steps the optimizer and the scheduler at the accumulation boundary."""

    def __call__(self, trainer, micro_batches):
        losses, tokens = [], 0
        for batch in micro_batches:
            loss = trainer.compute_loss(batch)
            trainer.engine.backward(loss)
            trainer.engine.step()
            losses.append(loss.detach().float())
            tokens += count_tokens(batch)
        return torch.stack(losses).mean(), tokens
