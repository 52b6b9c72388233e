"""Step strategies: how one optimizer step is carried out, chosen once at assembly.

A strategy is called with the trainer and the micro-batches of one optimizer step and returns
(this rank's loss, real tokens trained on this rank). The loss is the one whose gradient this
rank contributes before DeepSpeed averages gradients over the data-parallel ranks: the mean of
the ranks' values is the step's loss (`Trainer._reduce` takes it). With `train.loss_average`
"tokens" (default) that is the sum of this rank's token losses times dp_size / N, N the label
tokens of the whole step on every rank (engine.objectives.losses); with "micro_batch", the mean of this
rank's micro-batch means.

The run's method object picks the strategy (engine.model.methods): the fused LOMO / AdaLomo step
(engine.lomo.FusedStep), or else the layout's, which is this engine step or the pipeline
schedule (engine.parallel.pipeline.PipelineStep). A user's `train_fn` has the same signature
and may call `step_window` and `trainer.compute_loss(batch, window=...)` to weigh as we do.

A strategy may keep numbers of its last step in a `metrics` dict (the preference step's rewards,
engine.objectives.preference_step); `engine.monitors.StepMetricsMonitor` puts them in the step's record.
A strategy that fires hooks inside the step keeps what they asked of the loop, besides the skip it
carries out itself, in `asked` (a Signal); the loop acts on it with the step's other signals
(`asked_by`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.callbacks import NOTHING, Signal
from engine.data import count_tokens
from engine.objectives.losses import Window, window_of


class StepStrategy(Protocol):
    def __call__(self, trainer, micro_batches: list[dict]) -> tuple[torch.Tensor, int]: ...


def asked_by(strategy: object) -> Signal:
    """What the hooks inside `strategy`'s last step asked of the loop (nothing for a strategy,
    or a user's train_fn, that fires none)."""
    asked = getattr(strategy, "asked", NOTHING)
    return asked if isinstance(asked, Signal) else NOTHING


def step_window(trainer, micro_batches: list[dict]) -> Window:
    """How this step weighs its micro-batches (`train.loss_average`); with "tokens" it counts the
    step's label tokens over the data-parallel group (collective: every rank calls it)."""
    env = trainer.env
    return window_of(trainer.config.train.loss_average, micro_batches, shifted=trainer.method.targets_shifted,
                     dp_group=env.dp_group, dp_size=env.dp_size)


class EngineStep:
    """The DeepSpeed engine's own forward / backward / step; it accumulates across micro-batches
    and steps the optimizer and the scheduler at the accumulation boundary.

    Two callback hooks let the spike guard in (engine.guard.hook): with one micro-batch per step,
    `on_before_backward` sees the loss first (this rank's share; the ranks' mean is the step's
    loss), and a `skip` signal from it means neither backward nor update (DeepSpeed's counters do
    not move, as for its own skipped fp16 steps); whatever else it asks is kept in `asked` for
    the loop. `on_before_optimizer_step` comes once the gradients are reduced, before they are
    applied."""

    asked: Signal = NOTHING  # what on_before_backward asked of the loop in the last step, less the skip

    def __call__(self, trainer, micro_batches):
        window = step_window(trainer, micro_batches)
        # token-weighted: each loss is already its share of the whole step, so DeepSpeed must not
        # divide by the accumulation steps, and `scale` undoes its mean over the ranks
        scale_wrt_gas = window.num_items is None
        judged_first = len(micro_batches) == 1  # later micro-batches would judge after gradients exist
        engine, losses, tokens, self.asked = trainer.engine, [], 0, NOTHING
        for batch in micro_batches:
            loss = self.micro_loss(trainer, batch, window)
            share = loss * window.scale  # this rank's part of the step's loss: the ranks' mean is the loss
            signal = trainer.callbacks.fire("on_before_backward", trainer, share) if judged_first else NOTHING
            self.asked = self.asked | signal.without_skip()
            if not signal.skip:
                engine.backward(share, scale_wrt_gas=scale_wrt_gas)
                if engine.is_gradient_accumulation_boundary():
                    trainer.callbacks.fire("on_before_optimizer_step", trainer)
                engine.step()
            losses.append(loss.detach().float())
            tokens += count_tokens(batch)
        if window.num_items is None:
            return torch.stack(losses).mean(), tokens
        return torch.stack(losses).sum() * window.scale, tokens

    def micro_loss(self, trainer, batch: dict, window: Window) -> torch.Tensor:
        """One micro-batch's loss for `window` (a subclass adds terms: an SFT run's live
        preference pairs, engine.objectives.preference_step.SftStep)."""
        return trainer.compute_loss(batch, window=window)
