"""GRPO and its variants (grpo, dr_grpo, dapo, bnpo): advantages from the rewards of each
prompt's group of sampled answers, and the clipped policy-gradient loss (docs/rewards.md).

The numbers are TRL's GRPOTrainer's (trl 1.16, `loss_type`, `scale_rewards`, `epsilon`, `beta`),
which the parity tests hold us to:

* advantages: (reward - the group's mean) / (std + 1e-4), the std Bessel-corrected over the group
  (scale_rewards "group"), over the whole step on every rank ("batch"), or no division ("none");
  an unscored sample (every reward function said None) counts in no mean and gets advantage 0;
* per token: ratio = exp(logp - old logp) (1 on the samples' first use: old = logp detached),
  loss = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A), plus beta times the
  k3 estimate of the KL to the reference, exp(ref - logp) - (ref - logp) - 1, times the ratio
  (TRL's `use_bias_correction_kl`, on by default; the `kl` metric is this product);
* a micro-batch's loss, as its gradient contribution (already divided by the accumulation steps;
  the data-parallel ranks' gradients are averaged): grpo, the mean over answers of each answer's
  token mean, / gas; bnpo, the token mean of the micro-batch, / gas; dr_grpo, the token sum /
  (answers x max_completion_length), / gas; dapo, the token sum / (the step's answer tokens on
  every rank / ranks);
* log-probabilities are of the logits divided by the sampling temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Sums = dict[str, tuple[torch.Tensor, torch.Tensor]]  # metric -> (sum, count), summed over ranks later
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The Bessel-corrected standard deviation ignoring NaN (NaN with fewer than 2 values)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    out = variance.sqrt()
    return out.squeeze(dim) if dim is not None else out.reshape(())


def advantages_of(rewards: torch.Tensor, num_generations: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, zero-std flags) of `rewards` (N,), N = groups x num_generations, each group's
    samples together; NaN marks an unscored sample."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif scale in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale!r}")
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def token_logps(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities (B, C) of the completion tokens under `logits` (B, C, V), the logits of
    the positions that predict them, divided by the temperature (float32)."""
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class GrpoLoss:
    """The loss of one micro-batch of sampled answers (see the module docstring)."""
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.0  # 0: epsilon
    beta: float = 0.0
    max_completion_length: int = 256

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"grpo.loss_type must be one of {LOSS_TYPES}, not {self.loss_type!r}")

    def __call__(self, logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *,
                 old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                 gas: int = 1, step_tokens: float = 0.0, ranks: int = 1) -> tuple[torch.Tensor, Sums]:
        """(the micro-batch's loss, its metric sums). `logps`, `mask` (B, C); `advantages` (B,);
        `step_tokens`: the answer tokens of the whole step on every rank (dapo)."""
        mask = mask.to(logps.dtype)
        old = logps.detach() if old_logps is None else old_logps
        ratio = torch.exp(logps - old)
        high = self.epsilon_high or self.epsilon
        adv = advantages.unsqueeze(1)
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - self.epsilon, 1 + high) * adv)
        kl = None
        if self.beta != 0.0:
            if ref_logps is None:
                raise ValueError("grpo with beta > 0 needs the reference's log-probabilities")
            # k3, times the ratio (TRL's default use_bias_correction_kl: the unbiased reverse-KL gradient)
            kl = (torch.exp(ref_logps - logps) - (ref_logps - logps) - 1) * ratio
            per_token = per_token + self.beta * kl
        loss = self._reduce(per_token, mask, gas, step_tokens, ranks)
        low_clip = (ratio < 1 - self.epsilon) & (adv < 0)
        high_clip = (ratio > 1 + high) & (adv > 0)
        sums = {"clip_ratio/low_mean": _masked(low_clip, mask), "clip_ratio/high_mean": _masked(high_clip, mask),
                "clip_ratio/region_mean": _masked(low_clip | high_clip, mask)}
        if kl is not None:
            sums["kl"] = _masked(kl, mask)
        return loss, sums

    def _reduce(self, per_token: torch.Tensor, mask: torch.Tensor, gas: int, step_tokens: float,
                ranks: int) -> torch.Tensor:
        total = (per_token * mask).sum()
        if self.loss_type == "grpo":
            return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / gas
        if self.loss_type == "bnpo":
            return total / mask.sum().clamp(min=1.0) / gas
        if self.loss_type == "dr_grpo":
            return total / (per_token.size(0) * self.max_completion_length) / gas
        return total / max(step_tokens / ranks, 1.0)  # dapo


def _masked(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over the answer tokens, their count), for a mean over every rank's tokens."""
    return (values.detach().float() * mask).sum(), mask.sum().float()
