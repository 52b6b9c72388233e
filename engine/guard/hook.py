"""The spike guard in the training loop: a callback the config adds (engine.assembly.loop.callbacks_of).

The decisions are engine.guard.decisions's (pure); this module feeds it and answers the loop with a
Signal (engine.callbacks): skip, rewind to X then scale the learning rate, or pause. The loop
carries it out (engine.trainer); the guard sets nothing on the trainer and swaps none of its parts.

When the guard judges
    Before the update, where the step lets it in: the run's DeepSpeed engine step (full and
    PEFT methods, not the pipeline) with one micro-batch per step. The engine step hands the guard
    its loss before the backward (`on_before_backward`); the guard makes it the same
    on every rank (one all-reduce of one number: the mean over the ranks, which is the step's
    loss as the trainer logs it), and judges it. A loss that passes goes on to backward and
    update as usual; one that does not is neither back-propagated nor applied, whatever the
    action, so no rank has a gradient or an update to undo (ZeRO 0-3 alike: no reduction ever
    started). DeepSpeed's own step counter and schedule are not advanced, as for DeepSpeed's own
    skipped fp16 steps.
    After the update, otherwise (LOMO / AdaLomo update inside backward, the pipeline schedule
    does all in one call, accumulated micro-batches are in the gradients already, a `train_fn`
    of your own), and always for the gradient norm, which exists only once the gradients are
    reduced. The norm is DeepSpeed's (`get_global_grad_norm`, ZeRO 1-3 and bf16/fp16), LOMO's,
    or, where DeepSpeed keeps none (ZeRO 0 in fp32: a plain torch optimizer), the norm of the
    reduced gradients taken just before the update (`on_before_optimizer_step`). Loss and norm are made equal
    on every rank by one all-reduce (max) of two numbers.

What an action does (every rank alike, at the end of the step, before the control boundary)
    skip      the engine step neither back-propagates nor applies (only possible before the
              update; after it the event says the update was applied).
    rewind    the loop's Trainer.rewind to the newest checkpoint (of the present branch or its
              ancestors) or snapshot at step s - 2 or before (spike_guard.newest_good), then the
              control plane's `set lr_scale` times guard.lr_scale. Nothing to rewind to: it
              pauses instead, saying why; a rewind refused: the loop pauses, saying why.
    pause     the control plane's pause: the run holds at this step's boundary, the model in
              memory, until a `resume` (or `rewind`, `branch`, `stop`).
Each is a `guard` event (contract.events.GuardEvent) with its trigger, value, threshold and
reason, written before what the action itself writes (`rewind`, `set`, `state` paused).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from contract.config.schema import GuardConfig, RunConfig
from contract.events import WarningEvent
from engine.callbacks import Callback, Signal
from engine.checkpoint import rewind as rewinding
from engine.guard.decisions import SpikeGuard, Verdict, newest_good


class GuardCallback(Callback):
    """The spike guard of a run (every rank has one); `from_config` gives None when it is off.
    It judges, emits its `guard` event and answers with a Signal; the loop carries it out."""

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.guard = SpikeGuard(cfg)
        self.norm_of_grads = False       # measure the reduced gradients' norm (DeepSpeed keeps none)
        self.verdict: Verdict | None = None  # this step's, when judged before the update
        self.grad_norm: float | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "GuardCallback | None":
        return cls(cfg.guard) if cfg.guard.enabled else None

    def on_after_trainer_initialized(self, trainer) -> None:
        engine = trainer.engine
        # ZeRO 0 in fp32 steps a plain torch optimizer, and DeepSpeed then keeps no norm
        self.norm_of_grads = engine.zero_optimization_stage() == 0 and not (
            engine.bfloat16_enabled() or engine.fp16_enabled())

    # -- inside the engine step (engine.steps.EngineStep) --------------------------------------
    def on_train_batch_begin(self, trainer, batch: list) -> None:
        self.verdict, self.grad_norm = None, None

    def on_before_backward(self, trainer, loss: torch.Tensor) -> Signal | None:
        """One micro-batch per step: judge the loss (the same on every rank) before anything is
        back-propagated; one that does not pass is neither back-propagated nor applied."""
        self.verdict = self.guard.judge_loss(_mean_over_ranks(float(loss.detach()), trainer.env.world_size))
        return None if self.verdict.ok else Signal(skip=True, reason=f"guard: {self.verdict.trigger}")

    def on_before_optimizer_step(self, trainer) -> None:
        if self.norm_of_grads:
            self.grad_norm = _norm_of_grads(trainer.engine.module)

    # -- after the step ----------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, loss: float) -> Signal | None:
        before = self.verdict  # judged before the update
        applied = before is None or before.ok
        loss, norm = _same_everywhere(loss, self._grad_norm(trainer) if applied else None, trainer.env.world_size)
        verdict = before if before is not None else self.guard.judge_loss(loss)
        if verdict.ok and applied:
            verdict = self.guard.judge_grad_norm(norm)
        step = trainer.state.global_step
        signal = None
        if not verdict.ok:
            verdict = self._feasible(trainer, verdict, applied)
            signal = self._announce(trainer, verdict, step, applied)
        self.guard.settle(loss, verdict)
        every = self.cfg.snapshot_every_n_steps
        if verdict.ok and every and step % every == 0:
            self._snapshot(trainer, step)
        return signal

    def _snapshot(self, trainer, step: int) -> None:
        """The guard's own snapshot; one that cannot be taken is a warning, not the run's end."""
        try:
            rewinding.take_snapshot(trainer, f"guard-{step}")
        except rewinding.RewindError as e:
            trainer.emit(WarningEvent(message=f"guard: no snapshot at step {step}: {e}"))

    # -- the actions ----------------------------------------------------------------------------
    def _feasible(self, trainer, verdict: Verdict, applied: bool) -> Verdict:
        """The verdict as this run can carry it out."""
        if verdict.action == "skip" and applied:
            return Verdict("none", verdict.trigger, f"{verdict.reason}; the update was applied already "
                           "(this step does not let the guard in first), so nothing is skipped",
                           verdict.value, verdict.threshold)
        if verdict.action in ("rewind", "pause") and trainer.control is None:
            return Verdict("none", verdict.trigger, f"{verdict.reason}; {verdict.action} needs the control "
                           "plane (control.enabled), so the guard only reports it", verdict.value, verdict.threshold)
        if verdict.action == "rewind" and self._target(trainer, step=trainer.state.global_step) is None:
            return self.guard.fallback(verdict, "there is no checkpoint or snapshot at step "
                                       f"{trainer.state.global_step - 2} or before to rewind to")
        return verdict

    def _announce(self, trainer, verdict: Verdict, step: int, applied: bool) -> Signal | None:
        """The `guard` event of `verdict`, and what it asks of the loop: rewind to the target and
        scale the learning rate (should the rewind be refused, the loop pauses, saying why), or
        pause. A skip has happened already (the step's update was held back)."""
        counts = {"rewinds": self.guard.rewinds + (verdict.action == "rewind"), "max_rewinds": self.cfg.max_rewinds,
                  "skips_in_a_row": self.guard.skips_in_a_row + (verdict.action == "skip"),
                  "update_applied": applied}
        reason = f"guard: {verdict.trigger}"
        if verdict.action == "rewind":
            name, target_step = self._target(trainer, step)  # type: ignore[misc]  # _feasible found one
            trainer.emit(verdict.event(step, target=name, target_step=target_step, lr_scale=self.cfg.lr_scale, **counts))
            return Signal(rewind=name, reason=reason, then_lr_scale=self.cfg.lr_scale)
        trainer.emit(verdict.event(step, **counts))
        return Signal(pause=True, reason=reason) if verdict.action == "pause" else None

    def _target(self, trainer, step: int) -> tuple[str, int] | None:
        """The newest checkpoint or snapshot at step - 2 or before (same list on every rank)."""
        there = rewinding.available(trainer)
        candidates = [(c, _step_of(c)) for names in there["checkpoints"].values() for c in names]
        snapshots = rewinding.snapshot_store(trainer).snapshots
        candidates += [(rewinding.SNAPSHOT_PREFIX + s.name, s.step) for s in snapshots]
        found = newest_good([(n, s) for n, s in candidates if s is not None], step)
        if found is not None and not found[0].startswith(rewinding.SNAPSHOT_PREFIX):
            found = (str(found[1]), found[1])  # a step number: the present branch's, else an ancestor's
        return found

    def _grad_norm(self, trainer) -> float | None:
        optimizer = trainer.optimizer
        if hasattr(optimizer, "last_grad_norm"):  # LOMO / AdaLomo measure it in their clipping pass
            return optimizer.last_grad_norm
        norm = trainer.engine.get_global_grad_norm()
        if norm is None:
            norm = self.grad_norm
        return None if norm is None else float(norm)


def _step_of(name: str) -> int | None:
    head, _, number = name.rpartition("-")
    return int(number) if head == "step" and number.isdigit() else None


def _mean_over_ranks(value: float, world_size: int) -> float:
    if world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0]) / world_size


def _same_everywhere(loss: float, norm: float | None, world_size: int) -> tuple[float, float | None]:
    """Loss and norm made equal on every rank (max; NaN as inf, which max keeps)."""
    if world_size == 1:
        return loss, norm
    t = torch.tensor([_orderable(loss), -1.0 if norm is None else _orderable(norm)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), None if t[1] < 0 else float(t[1])


def _orderable(x: float) -> float:
    return x if not math.isnan(x) else math.inf


def _norm_of_grads(module: torch.nn.Module) -> float:
    """The 2-norm of the gradients (reduced over the data-parallel ranks by DeepSpeed already)."""
    grads = [p.grad.detach().float() for p in module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
