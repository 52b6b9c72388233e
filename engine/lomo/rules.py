"""The update rules of LOMO and AdaLomo, on one whole (unpartitioned) parameter at a time.

A rule turns a parameter's gradient into an update direction `u` and a learning-rate factor;
the fused optimizer then applies ``p <- p * (1 - lr' * wd) - lr' * u`` with ``lr' = lr * factor``.
Rules see fp32 tensors of the parameter's full shape (under ZeRO-3 the gathered parameter), so
the same code serves every ZeRO stage.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class UpdateRule(Protocol):
    def init_state(self, shape: torch.Size, device: torch.device) -> dict[str, torch.Tensor]:
        """The per-parameter state this rule keeps (empty for LOMO)."""

    def direction(self, grad: torch.Tensor, state: dict, step: int) -> torch.Tensor:
        """The update direction for `grad` (fp32, may be modified in place); `step` counts from 1."""

    def lr_factor(self, param: torch.Tensor) -> float | torch.Tensor:
        """What the learning rate is multiplied by for this parameter (fp32 full tensor)."""


class LomoRule:
    """LOMO (Lv et al. 2023): plain SGD, applied while the backward pass goes. No state."""

    def init_state(self, shape: torch.Size, device: torch.device) -> dict[str, torch.Tensor]:
        return {}

    def direction(self, grad: torch.Tensor, state: dict, step: int) -> torch.Tensor:
        return grad

    def lr_factor(self, param: torch.Tensor) -> float:
        return 1.0


class AdaLomoRule:
    """AdaLomo (Lv et al. 2023): Adafactor-style factored second moments, no first moment.

    Matrices keep one row and one column vector of mean squared gradients (that is all the state
    there is); vectors keep their full second moment (they are small). The update is normalised
    to RMS <= `clip_threshold` and the learning rate scaled by the parameter's own RMS.
    """

    def __init__(self, eps: tuple[float, float] = (1e-30, 1e-3), clip_threshold: float = 1.0,
                 decay_rate: float = -0.8):
        self.eps, self.clip_threshold, self.decay_rate = eps, clip_threshold, decay_rate

    def init_state(self, shape: torch.Size, device: torch.device) -> dict[str, torch.Tensor]:
        zeros = lambda *s: torch.zeros(s, dtype=torch.float32, device=device)  # noqa: E731
        if len(shape) >= 2:
            return {"row": zeros(*shape[:-1]), "col": zeros(*shape[:-2], shape[-1])}
        return {"sq": zeros(*shape)}

    def direction(self, grad: torch.Tensor, state: dict, step: int) -> torch.Tensor:
        beta = 1.0 - math.pow(step, self.decay_rate)  # 0 at step 1: the first moments are exact
        sq = grad.square().add_(self.eps[0])
        if "row" in state:
            state["row"].mul_(beta).add_(sq.mean(dim=-1), alpha=1.0 - beta)
            state["col"].mul_(beta).add_(sq.mean(dim=-2), alpha=1.0 - beta)
            del sq
            row, col = state["row"], state["col"]
            row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            update = col.unsqueeze(-2).rsqrt().mul(row_factor).mul_(grad)
        else:
            state["sq"].mul_(beta).add_(sq, alpha=1.0 - beta)
            update = state["sq"].rsqrt().mul_(grad)
        rms = update.norm() / math.sqrt(update.numel())
        return update.div_((rms / self.clip_threshold).clamp_(min=1.0))

    def lr_factor(self, param: torch.Tensor) -> torch.Tensor:
        rms = param.norm() / math.sqrt(param.numel())
        return rms.clamp(min=self.eps[1])
