"""Step strategies: how one optimizer step is carried out, chosen once from the config.

A strategy is called with the trainer and the micro-batches of one optimizer step and returns
(mean loss over the micro-batches as a float tensor, real tokens trained on this rank).
The fused LOMO / AdaLomo step and the pipeline step plug in here as further strategies.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from contract.config import RunConfig
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


# Strategies registered by the method and parallel layers: (predicate on config, factory).
_STRATEGIES: list[tuple[Callable[[RunConfig], bool], Callable[[RunConfig], StepStrategy]]] = []


def register_strategy(applies: Callable[[RunConfig], bool], factory: Callable[[RunConfig], StepStrategy]) -> None:
    """Make a step strategy available; the first whose predicate holds for a config wins."""
    _STRATEGIES.append((applies, factory))


def choose_strategy(cfg: RunConfig) -> StepStrategy:
    for applies, factory in _STRATEGIES:
        if applies(cfg):
            return factory(cfg)
    return EngineStep()


def _pipeline_step(cfg: RunConfig) -> StepStrategy:
    from engine.parallel.pipeline import PipelineStep
    return PipelineStep()


# pipeline parallelism: DeepSpeed's pipeline schedule (engine.train_batch) replaces the loop above
register_strategy(lambda cfg: cfg.parallel.pp_size > 1, _pipeline_step)
