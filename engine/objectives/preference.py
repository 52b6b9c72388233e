"""The preference objectives: DPO (and its IPO, hinge and robust losses), ORPO, SimPO and KTO.

One object per run, chosen once at assembly from `preference.objective` (`objective_of`); "sft"
has none and the run keeps its step strategy. An objective turns the log-probabilities of a
micro-batch's answers (the policy's, and the reference's where it needs one) into the loss of the
micro-batch and its metrics. The step strategy that runs them is `engine.objectives.preference_step`.

Conventions (TRL's defaults, which the parity tests hold us to; docs/preferences.md):

* an answer's log-probability is the sum over its tokens (the answer only, eos included);
  SimPO, ORPO and IPO use the per-token mean instead;
* a micro-batch's loss is the mean over its pairs (KTO: over its rows); accumulation and the
  data-parallel ranks average those means (TRL / the HF Trainer do the same);
* rewards: DPO and KTO beta * (policy - reference) log-probability; SimPO beta * the mean
  log-probability; ORPO lambda * the mean log-probability;
* metrics are TRL's names: rewards/chosen, rewards/rejected, rewards/accuracies,
  rewards/margins, logps/chosen, logps/rejected (KTO: no accuracies, plus kl; ORPO: plus
  nll_loss, log_odds_ratio, log_odds_chosen). Each is a mean over every rank's rows of the
  micro-batch, and a step's value is the mean over its micro-batches.

Metrics are returned as (sum, count) pairs so that the step adds them over the data-parallel
ranks in one all-reduce; `finish` derives the ones that need the totals (KTO's margin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from contract.config.preference_checks import sft_pair_loss
from contract.config.schema import REFERENCE_OBJECTIVES, PreferenceConfig, RunConfig
from contract.data_check import objective_problem
from contract.data_rows import IGNORE, DataError

Sums = dict[str, tuple[torch.Tensor, torch.Tensor]]  # metric -> (sum over rows, rows counted)


@dataclass
class Scores:
    """Per-row log-probabilities of a batch's answers: `sums` (N,), `tokens` (N,) answer tokens;
    `token_logps` (N, K-1) of the next tokens the forward scored (K = T, every one, unless the
    forward kept only the tail that holds every answer, `answer_tail`) and `attention` (N, K-1)
    where they are real (ORPO's likelihood term is over the whole chosen sequence, prompt included)."""
    sums: torch.Tensor
    tokens: torch.Tensor
    token_logps: torch.Tensor
    attention: torch.Tensor

    @property
    def means(self) -> torch.Tensor:
        return self.sums / self.tokens.clamp(min=1)

    def halves(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen rows, rejected rows) of a pair batch."""
        return values.chunk(2, dim=0)


def answer_tail(labels: torch.Tensor) -> int:
    """How many last positions of the rows predict every answer token (from the one before the
    earliest answer token of any row to the end); 0 (every position) if that is all of them.
    A forward asked for only these positions' logits (transformers' `logits_to_keep`) skips the
    output head and the log-softmax over the vocabulary on the prompts' common part."""
    columns = (labels != IGNORE).any(dim=0).nonzero()
    if columns.numel() == 0:
        return 0
    first = int(columns[0, 0])  # a sync: one number
    return labels.size(1) - first + 1 if first > 1 else 0


def scores_of(logits: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
              attention_mask: torch.Tensor) -> Scores:
    """Log-probabilities of each row's next tokens under `logits` (N, K, V), in float32: the
    logits of the rows' last K positions (K = T: all of them; fewer: `answer_tail`)."""
    kept = min(logits.size(1), input_ids.size(1))  # prompt tuning puts virtual positions in front
    logits = logits[:, -kept:]
    start = input_ids.size(1) - kept + 1  # the first token predicted
    targets = input_ids[:, start:]
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    answer = labels[:, start:] != IGNORE
    return Scores(sums=(logps * answer).sum(-1), tokens=answer.sum(-1), token_logps=logps,
                  attention=attention_mask[:, start:].bool())


def _mean(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = values.detach().float()
    return values.sum(), torch.tensor(float(values.numel()))


class Objective(Protocol):
    name: str
    needs_reference: bool   # the step computes the reference's scores (policy without adapter, or a frozen copy)
    kl_rows: bool           # the batch has KL rows whose scores the loss needs (KTO)
    whole_rows: bool        # the loss needs every token's log-probability, not only the answers' (ORPO)

    def loss(self, policy: Scores, reference: Scores | None, batch: dict, extra: dict) -> tuple[torch.Tensor, Sums]: ...
    def finish(self, values: dict[str, float]) -> dict[str, float]: ...


def _pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> Sums:
    return {"rewards/chosen": _mean(chosen_rewards), "rewards/rejected": _mean(rejected_rewards),
            "rewards/accuracies": _mean((chosen_rewards > rejected_rewards).float()),
            "rewards/margins": _mean(chosen_rewards - rejected_rewards),
            "logps/chosen": _mean(chosen_logps), "logps/rejected": _mean(rejected_logps)}


class _Base:
    needs_reference = False
    kl_rows = False
    whole_rows = False

    def finish(self, values: dict[str, float]) -> dict[str, float]:
        return values


class DPO(_Base):
    """Direct preference optimisation against the reference; `variant` sigmoid / ipo / hinge / robust."""
    name, needs_reference = "dpo", True

    def __init__(self, beta: float, variant: str = "sigmoid", label_smoothing: float = 0.0):
        self.beta, self.variant, self.smoothing = beta, variant, label_smoothing

    def loss(self, policy, reference, batch, extra):
        assert reference is not None
        chosen, rejected = policy.halves(policy.sums)
        ref_chosen, ref_rejected = reference.halves(reference.sums)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = chosen_ratio - rejected_ratio
        b = self.beta
        if self.variant == "ipo":  # per answer token, so that beta means the same whatever the lengths
            chosen_tokens, rejected_tokens = policy.halves(policy.tokens.clamp(min=1))
            losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * b)) ** 2
        elif self.variant == "hinge":
            losses = torch.relu(1 - b * delta)
        elif self.variant == "robust":
            eps = self.smoothing
            losses = (-(1 - eps) * F.logsigmoid(b * delta) + eps * F.logsigmoid(-b * delta)) / (1 - 2 * eps)
        else:
            losses = -F.logsigmoid(b * delta)
        return losses.mean(), _pair_metrics(b * chosen_ratio, b * rejected_ratio, chosen, rejected)


class SimPO(_Base):
    """Reference-free: the mean log-probabilities' margin against a target margin gamma."""
    name = "simpo"

    def __init__(self, beta: float, gamma: float):
        self.beta, self.gamma = beta, gamma

    def loss(self, policy, reference, batch, extra):
        chosen, rejected = policy.halves(policy.means)
        losses = -F.logsigmoid(self.beta * (chosen - rejected) - self.gamma)
        return losses.mean(), _pair_metrics(self.beta * chosen, self.beta * rejected, chosen, rejected)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ORPO(_Base):
    """Odds-ratio preference: the chosen sequences' negative log-likelihood (every real token,
    prompt included, as TRL does) minus lambda times log sigmoid of the log odds ratio."""
    name = "orpo"
    whole_rows = True

    def __init__(self, lam: float, with_nll: bool = True):
        self.lam, self.with_nll = lam, with_nll  # False: the odds-ratio term alone (an SFT run's live pairs)

    def loss(self, policy, reference, batch, extra):
        chosen, rejected = policy.halves(policy.means)
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        chosen_logps, _ = policy.halves(policy.token_logps)
        chosen_real, _ = policy.halves(policy.attention)
        nll = -(chosen_logps * chosen_real).sum() / chosen_real.sum().clamp(min=1)
        metrics = _pair_metrics(self.lam * chosen, self.lam * rejected, chosen, rejected)
        if self.with_nll:
            metrics["nll_loss"] = _mean(nll)
        metrics.update({"log_odds_ratio": _mean(ratio.mean()), "log_odds_chosen": _mean(log_odds.mean())})
        return (nll if self.with_nll else 0.0) - self.lam * ratio.mean(), metrics


class KTO(_Base):
    """Kahneman-Tversky optimisation: each answer, desirable or not, against the reference point
    kl (the batch's mismatched prompt / completion rows, policy against reference, over every
    data-parallel rank, clamped at 0)."""
    name, needs_reference, kl_rows = "kto", True, True

    def __init__(self, beta: float, desirable_weight: float, undesirable_weight: float, dp_group=None,
                 dp_size: int = 1):
        self.beta, self.weights = beta, (desirable_weight, undesirable_weight)
        self.dp_group, self.dp_size = dp_group, dp_size

    def loss(self, policy, reference, batch, extra):
        assert reference is not None
        kl = (extra["policy_kl"].sums - extra["reference_kl"].sums).mean().detach()
        if self.dp_size > 1:
            dist.all_reduce(kl, group=self.dp_group)
            kl = kl / self.dp_size
        kl = kl.clamp(min=0)
        desirable = batch["desirable"].bool()
        ratio = policy.sums - reference.sums
        b = self.beta
        losses = torch.where(desirable, self.weights[0] * (1 - torch.sigmoid(b * (ratio - kl))),
                             self.weights[1] * (1 - torch.sigmoid(b * (kl - ratio))))
        rewards = (b * ratio).detach()
        metrics: Sums = {"kl": (kl.float(), torch.tensor(1.0))}
        for side, rows in (("chosen", desirable), ("rejected", ~desirable)):
            n = torch.tensor(float(rows.sum()))
            metrics[f"rewards/{side}"] = (rewards[rows].float().sum(), n)
            metrics[f"logps/{side}"] = (policy.sums[rows].detach().float().sum(), n)
        return losses.mean(), metrics

    def finish(self, values: dict[str, float]) -> dict[str, float]:
        if "rewards/chosen" in values and "rewards/rejected" in values:
            values["rewards/margins"] = values["rewards/chosen"] - values["rewards/rejected"]
        return values


def objective_of(cfg: RunConfig, dp_group=None, dp_size: int = 1) -> Objective | None:
    """The run's objective (None for sft: the run's own step strategy trains)."""
    p: PreferenceConfig = cfg.preference
    if p.objective == "dpo":
        return DPO(p.beta, p.dpo_loss, p.label_smoothing)
    if p.objective == "simpo":
        return SimPO(p.beta, p.simpo_gamma)
    if p.objective == "orpo":
        return ORPO(p.orpo_lambda)
    if p.objective == "kto":
        return KTO(p.beta, p.kto_desirable_weight, p.kto_undesirable_weight, dp_group, dp_size)
    return None


def sft_pair_objective(cfg: RunConfig) -> Objective:
    """The preference loss an SFT run adds for the live pairs it is sent (`preference.sft_pairs`,
    contract.config.preference_checks.sft_pair_loss): ORPO's odds-ratio term alone (the chosen
    answer's likelihood is in the SFT loss already), SimPO, or DPO against the model without
    its adapter."""
    p: PreferenceConfig = cfg.preference
    loss = sft_pair_loss(cfg)
    if loss == "dpo":
        return DPO(p.beta, p.dpo_loss, p.label_smoothing)
    if loss == "simpo":
        return SimPO(p.beta, p.simpo_gamma)
    return ORPO(p.orpo_lambda, with_nll=False)


def rows_problem(cfg: RunConfig, fmt: str, source: str) -> str | None:
    """Why rows of format `fmt` (from `source`) cannot train this run's objective, or None: the
    pre-flight check's own rule (contract.data_check.objective_problem), so what is refused
    before launch and what a rank or a live data command refuses are one rule, in the same words."""
    return objective_problem(cfg.preference.objective, fmt, source)


def check_data(cfg: RunConfig, reports: dict) -> None:
    """Refuse training data whose rows do not fit the objective (formats detected when read)."""
    for name, report in reports.items():
        problem = rows_problem(cfg, report.format, report.source) if name.startswith("train") else None
        if problem:
            raise DataError(f"data: {problem}")


def needs_reference(cfg: RunConfig) -> bool:
    return cfg.preference.objective in REFERENCE_OBJECTIVES
