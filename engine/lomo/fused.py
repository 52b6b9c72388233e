"""The fused optimizer: each parameter is updated inside backward, the moment its gradient is ready.

A post-accumulate-grad hook on every trainable parameter takes the gradient, averages it over
the data-parallel group, applies the update rule and drops the gradient, so at most one
parameter's gradient exists at any time and no optimizer state is kept beyond the rule's own
(AdaLomo's factored second moments).

Clipping by the global norm needs the norm before the first parameter is updated, so a step
with clipping (or with fp16 loss scaling, which must find overflows before anything changes)
makes two passes: a *measure* pass whose hooks only add up the squared gradient norm, then the
*update* pass. Without ZeRO-3 the update pass is a second backward through the retained graph.
Under ZeRO-3 that graph cannot be reused (its parameters were released after the first
backward), so the update pass runs a second forward with the random state of the first, which
gives the same gradients.

It subclasses torch.optim.Optimizer only for its interface: `param_groups` carries the learning
rate (so the trainer's schedulers, `current_lr` and `set_lr` work unchanged) and `state` the
AdaLomo moments (so `state_dict` checkpoints them). `step()` updates nothing: it closes a step
whose updates already happened.
"""

from __future__ import annotations

import enum
import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from engine.parallel import ds_config
from engine.lomo.rules import UpdateRule
from engine.lomo.scaler import DynamicLossScaler
from engine.rng import rng_state, set_rng_state


class _Pass(enum.Enum):
    OFF = "off"          # backward outside a fused step: gradients are left alone
    MEASURE = "measure"  # add up the global gradient norm, change nothing
    UPDATE = "update"    # apply the update rule


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's real shape (ZeRO-3 parameters are empty placeholders outside forward)."""
    return torch.Size(ds_config.full_shape(p))


class FusedOptimizer(torch.optim.Optimizer):
    """LOMO / AdaLomo: the update rule applied inside backward (see the module docstring).

    `max_grad_norm` > 0 clips the global gradient norm; `scaler` (fp16) scales the loss and
    skips steps whose gradients overflow; `dp_group` / `dp_size` are the data-parallel group the
    gradients are averaged over; `after_backward` runs after every backward (under ZeRO-3:
    DeepSpeed's release of parameters whose modules had no input needing a gradient, such as
    the embedding, which its own optimizer would do at the end of backward).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], rule: UpdateRule, *, lr: float,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 scaler: DynamicLossScaler | None = None, dp_group=None, dp_size: int = 1,
                 after_backward: Callable[[], None] | None = None):
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("method.name: LOMO / AdaLomo found no trainable parameter")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.rule, self.max_grad_norm, self.scaler = rule, max_grad_norm, scaler
        self.dp_group, self.dp_size, self.after_backward = dp_group, dp_size, after_backward
        self.partitioned = any(ds_config.is_partitioned(p) for p in params)  # ZeRO-3
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        self._pass = _Pass.OFF
        self._sq_norm: torch.Tensor | None = None
        self._clip_coef = 1.0
        self.last_grad_norm: float | None = None
        self.last_skipped = False
        self.skipped_steps = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    # -- one training step ----------------------------------------------------------------------
    def fused_step(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Forward, backward with the update fused in, and return the loss (unscaled).

        `forward` computes the loss; under ZeRO-3 with a measure pass it is called twice.
        A step whose gradients are not finite is skipped: no parameter changes
        (`last_skipped` is then True and the loss scale, if any, is lowered).
        """
        measure = self.max_grad_norm > 0 or self.scaler is not None
        rng = rng_state() if measure and self.partitioned else None
        loss = forward()
        self._clip_coef, self.last_skipped = 1.0, False
        if measure:
            norm = self._backward(loss, _Pass.MEASURE, retain_graph=not self.partitioned)
            self.last_grad_norm = norm
            if not math.isfinite(norm):
                self._skip()
                return loss.detach()
            if self.max_grad_norm > 0:
                self._clip_coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
            if self.partitioned:  # ZeRO-3 released the graph's parameters: forward once more
                set_rng_state(rng)
                loss = forward()
        self._backward(loss, _Pass.UPDATE)
        self.step()
        return loss.detach()

    @torch.no_grad()
    def step(self, closure=None):
        """Close a step whose updates happened in backward (nothing left to apply)."""
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return None

    def _skip(self) -> None:
        self.last_skipped = True
        self.skipped_steps += 1
        if self.scaler is not None:
            self.scaler.update(overflow=True)

    def _backward(self, loss: torch.Tensor, which: _Pass, retain_graph: bool = False) -> float:
        """One backward with the hooks in mode `which`; returns the global gradient norm when
        measuring (identical on every rank: it is taken from the averaged gradients)."""
        self._pass = which
        self._sq_norm = torch.zeros((), dtype=torch.float32, device=loss.device)
        try:
            scaled = loss.float() * self.scaler.scale if self.scaler is not None else loss
            scaled.backward(retain_graph=retain_graph)
        finally:
            self._pass = _Pass.OFF
            if self.after_backward is not None:
                self.after_backward()
        return float(self._sq_norm.sqrt()) if which is _Pass.MEASURE else 0.0

    # -- the hook -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if self._pass is _Pass.OFF or p.grad is None:
            return
        grad = p.grad.float()  # fp32 for the all-reduce and the update; aliases p.grad when fp32
        p.grad = None          # the gradient's memory goes as soon as this hook is done
        if self.dp_size > 1:
            dist.all_reduce(grad, group=self.dp_group)
        divisor = self.dp_size * (self.scaler.scale if self.scaler is not None else 1.0)
        if divisor != 1.0:
            grad.div_(divisor)
        if self._pass is _Pass.MEASURE:
            self._sq_norm += torch.linalg.vector_norm(grad).square()
            return
        if self._clip_coef != 1.0:
            grad.mul_(self._clip_coef)
        self._apply(p, grad)

    def _apply(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        group, state = self._group_of[p], self.state[p]
        if not state:
            state.update(self.rule.init_state(full_shape(p), grad.device))
            state["step"] = 0
        state["step"] += 1
        full = p.data
        if self.partitioned and full.numel() != grad.numel():
            raise RuntimeError("ZeRO-3 released a parameter before its gradient hook ran; the fused "
                               "update needs the gathered parameter")
        weight = full.float()  # aliases the parameter when it is fp32
        update = self.rule.direction(grad.view(full.shape), state, state["step"])
        lr = group["lr"] * self.rule.lr_factor(weight)
        if group["weight_decay"] and len(full_shape(p)) >= 2:  # no decay on biases and norms
            weight.mul_(1.0 - lr * group["weight_decay"])
        weight.sub_(update.mul_(lr))
        if weight.data_ptr() != full.data_ptr():
            full.copy_(weight)
        if self.partitioned:
            ds_config.write_partition(p, full)  # the partition is what the next gather reads

    def remove_hooks(self) -> None:
        """Detach from the model (the parameters go back to ordinary gradients)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["loss_scaler"] = self.scaler.state_dict() if self.scaler is not None else None
        out["skipped_steps"] = self.skipped_steps
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop("loss_scaler", None)
        self.skipped_steps = int(state_dict.pop("skipped_steps", 0))
        super().load_state_dict(state_dict)
        # torch's load puts new group dicts in `param_groups`: the per-parameter lookup follows
        # them (else the update would read the learning rate of the groups from before the load)
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        if scaler_state is not None and self.scaler is not None:
            self.scaler.load_state_dict(scaler_state)

