"""The step strategy of a preference objective, and the reference model it compares with.

`PreferenceStep` is chosen once at assembly (`step_for`) in place of the engine step when
`preference.objective` is not sft. For each micro-batch: the policy's forward through the
DeepSpeed engine (chosen and rejected rows in one batch), the reference's forward without
gradient where the objective needs one, the objective's loss (engine.objectives.preference), the engine's
backward and step (DeepSpeed accumulates and averages over the ranks, as for the per-micro-batch
SFT loss). It returns the mean of its micro-batch losses; its `metrics` hold the step's rewards
and log-probabilities, which `engine.monitors.StepMetricsMonitor` writes into the step's record.

The reference (`Reference`), where the objective needs one:

* PEFT methods: the policy itself with its adapter disabled (`method.base_model`) -- no memory
  beyond the policy's, one more forward without gradient per micro-batch;
* full fine-tuning: a frozen copy of the initial model, built at assembly in the run's layout:
  ZeRO 0-2 and tensor parallel: a whole copy of the weights on every rank (no gradients, no
  optimizer state: about a quarter of what the policy's weights, gradients and Adam states take
  in fp32); ZeRO-3: partitioned like the policy (its weights / dp_size per rank), gathered layer
  by layer in its forward as the policy's are. It is rebuilt the same way at resume (the same
  seed or model folder), so a resumed run compares with the same reference.

An SFT run keeps the engine step, as `SftStep`: the same step until a preference arrives from the
chat, then, on the steps whose batches hold one, the SFT loss plus the pair loss of
`preference.sft_pairs` (docs/preferences.md, "The rule for an SFT run").
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

from contract import capabilities
from engine.data.inbox import PAIR_PREFIX
from engine.objectives.losses import Window, model_logits
from engine.objectives.preference import Objective, Scores, answer_tail, scores_of, sft_pair_objective
from engine.steps import EngineStep, StepStrategy

# (input_ids, attention_mask[, keep]) -> logits; keep > 0: those of the last `keep` positions at least
Forward = Callable[..., torch.Tensor]


class AdapterOffReference:
    """The policy with its PEFT adapter disabled."""

    def __init__(self, run):
        self.run = run

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int = 0) -> torch.Tensor:
        engine = self.run.engine
        with torch.no_grad(), self.run.method.base_model(engine.module):
            return model_logits(engine, input_ids, attention_mask, keep)


class FrozenReference:
    """A frozen copy of the initial model (a module, or a DeepSpeed engine under ZeRO-3)."""

    def __init__(self, model):
        self.model = model

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int = 0) -> torch.Tensor:
        with torch.no_grad():
            return model_logits(self.model, input_ids, attention_mask, keep)


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off (TRL's `disable_dropout`, its default): the policy's and the reference's
    log-probabilities of the same answer must be comparable."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def copy_before_engine(model: torch.nn.Module, zero_stage: int) -> torch.nn.Module | None:
    """The reference copy of a full fine-tuning run's model, taken before the engine wraps it;
    None under ZeRO-3, where the model is partitioned (`zero3_reference` builds it instead)."""
    if zero_stage == 3:
        return None
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def place_copy(ref: torch.nn.Module, engine) -> FrozenReference:
    """The copy on the engine's device in the dtype the engine trains in."""
    dtype = next(engine.module.parameters()).dtype
    return FrozenReference(ref.to(device=engine.device, dtype=dtype))


def zero3_reference(build: Callable[[], torch.nn.Module], ds_config: dict) -> FrozenReference:
    """A ZeRO-3 partitioned copy of the initial model: `build()` makes it (under zero.Init, with
    the run's seed), DeepSpeed wraps it without an optimizer so that its forward gathers each
    layer's weights as the policy's does (TRL's `prepare_deepspeed`)."""
    import deepspeed
    config = {k: v for k, v in copy.deepcopy(ds_config).items() if k not in ("optimizer", "scheduler")}
    zero = dict(config.get("zero_optimization", {}))
    zero.pop("offload_optimizer", None)
    config["zero_optimization"] = zero
    model = build()
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return FrozenReference(engine)


class PreferenceStep:
    """One optimizer step of a preference objective (see the module docstring)."""

    def __init__(self, objective: Objective, reference: Any = None):
        self.objective, self.reference = objective, reference
        self.metrics: dict[str, float] = {}

    def __call__(self, trainer, micro_batches: list[dict]) -> tuple[torch.Tensor, int]:
        losses, tokens, per_batch = [], 0, []
        for batch in micro_batches:
            batch = {k: v.to(trainer.engine.device) for k, v in batch.items()}
            loss, sums = self.micro_batch(trainer.engine, batch)
            trainer.engine.backward(loss)
            trainer.engine.step()
            losses.append(loss.detach().float())
            tokens += int(batch["attention_mask"].sum())
            per_batch.append(reduce_metrics(sums, trainer.env))
        self.metrics = self.objective.finish(mean_present(per_batch))
        return torch.stack(losses).mean(), tokens

    def micro_batch(self, engine, batch: dict) -> tuple[torch.Tensor, dict]:
        """The loss and the metric sums of one micro-batch (forwards in TRL's order). Where the
        objective needs the answers' log-probabilities only, the forwards compute the logits of
        the positions that predict an answer token (`answer_tail`): the output head and the
        log-softmax over the vocabulary skip the prompts' common part (TRL's fused output head
        skips every unlabelled position, on GPUs)."""
        extra: dict[str, Scores] = {}
        tail = not self.objective.whole_rows
        policy_logits = functools.partial(model_logits, engine)
        if self.objective.kl_rows:
            with torch.no_grad():
                extra["policy_kl"] = self._scores(policy_logits, batch, "kl_", tail)
        policy = self._scores(policy_logits, batch, tail=tail)
        reference = None
        if self.objective.needs_reference:
            if self.objective.kl_rows:
                extra["reference_kl"] = self._scores(self.reference.logits, batch, "kl_", tail)
            reference = self._scores(self.reference.logits, batch, tail=tail)
        return self.objective.loss(policy, reference, batch, extra)

    @staticmethod
    def _scores(forward: Forward, batch: dict, prefix: str = "", tail: bool = False) -> Scores:
        """The batch's scores; `tail`: asking `forward` for the answers' positions' logits only."""
        ids, mask, labels = batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"], batch[f"{prefix}labels"]
        keep = answer_tail(labels) if tail else 0
        logits = forward(ids, mask, keep) if keep else forward(ids, mask)
        return scores_of(logits, ids, labels, mask)


class PreferenceEvaluator:
    """The objective on the evaluation data, without gradient: `loss` (the mean of the batches'
    losses over every rank) and the reward metrics, as `eval/...` (TRL's `eval_rewards/...`).
    It takes the place of the perplexity evaluator in a preference run."""
    name = "preference"

    def __init__(self, step: PreferenceStep, max_samples: int = 0):
        self.step, self.max_samples = step, max_samples

    def __call__(self, trainer) -> dict[str, float]:
        per_step = trainer.config.eval.batch_size * trainer.env.dp_size
        batches = max(1, self.max_samples // per_step) if self.max_samples else None
        losses, per_batch = [], []
        for i, batch in enumerate(trainer.eval_loader()):
            if batches is not None and i >= batches:
                break
            batch = {k: v.to(trainer.engine.device) for k, v in batch.items()}
            loss, sums = self.step.micro_batch(trainer.engine, batch)  # every rank, every batch (ZeRO-3)
            losses.append(float(loss))
            per_batch.append(reduce_metrics(sums, trainer.env))
        if not losses:
            return {}
        mean = reduce_metrics({"loss": (torch.tensor(sum(losses)), torch.tensor(float(len(losses))))}, trainer.env)
        return {**mean, **self.step.objective.finish(mean_present(per_batch))}


def reduce_metrics(sums: dict, env) -> dict[str, float]:
    """Each metric's mean over every data-parallel rank's rows (one all-reduce); a metric no
    rank had rows for is left out."""
    if not sums:
        return {}
    names = sorted(sums)
    packed = torch.stack([torch.stack([sums[n][0].detach().float().cpu(), sums[n][1].float().cpu()])
                          for n in names]).double().to(env.device)
    if env.dp_size > 1:
        dist.all_reduce(packed, group=env.dp_group)
    packed = packed.cpu()
    return {n: float(packed[i, 0] / packed[i, 1]) for i, n in enumerate(names) if packed[i, 1] > 0}


def mean_present(values: list[dict[str, float]]) -> dict[str, float]:
    """A step's metric: the mean over its micro-batches that have it (TRL logs the same)."""
    names = dict.fromkeys(k for v in values for k in v)
    return {n: sum(v[n] for v in values if n in v) / sum(1 for v in values if n in v) for n in names}


# -- an SFT run's live pairs -------------------------------------------------------------------------

class SftStep(EngineStep):
    """The SFT engine step of a run that may be sent preference pairs from the chat.

    Until the inbox holds a pair it is the engine step itself (the Hugging Face Trainer's loss,
    no extra work). Then, on a step whose micro-batches hold pairs (the collator puts them under
    the `pair_` keys, engine.data.inbox; their chosen answers are rows of the SFT batch already),
    each micro-batch's loss gets the pair loss of `preference.sft_pairs`
    (engine.objectives.preference.sft_pair_objective) for its pairs, so that the step's loss is

        SFT loss (every row, chosen answers included) + the mean over the step's pairs of the pair loss

    on every rank and with any accumulation: each micro-batch adds its pairs' loss sum over the
    step's pair count P (counted over the data-parallel ranks, one all-reduce), scaled to undo
    DeepSpeed's averaging as the SFT share is. `metrics` then holds the pairs' rewards and
    log-probabilities (TRL's names: the mean over the step's pairs); empty on other steps."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.objective: Objective | None = None  # made at the first pair, from the run's config
        self._term: _PairTerm | None = None

    def __call__(self, trainer, micro_batches: list[dict]) -> tuple[torch.Tensor, int]:
        self.metrics = {}
        if not _may_hold_pairs(trainer):  # the same answer on every rank: no collective before a pair
            return super().__call__(trainer, micro_batches)
        key = PAIR_PREFIX + "input_ids"
        local = sum(int(b[key].size(0)) // 2 for b in micro_batches if key in b)
        total = _sum_over_ranks(local, trainer.env)
        if not total:
            return super().__call__(trainer, micro_batches)
        if self.objective is None:
            self.objective = sft_pair_objective(trainer.config)
        reference = AdapterOffReference(trainer) if self.objective.needs_reference else None
        self._term = _PairTerm(self.objective, reference, trainer, total)
        try:
            result = super().__call__(trainer, micro_batches)
            term = self._term
        finally:
            self._term = None
        self.metrics = term.finish(trainer.env)
        return result

    def micro_loss(self, trainer, batch: dict, window: Window) -> torch.Tensor:
        sft = {k: v for k, v in batch.items() if not k.startswith(PAIR_PREFIX)}
        loss = trainer.compute_loss(sft, window=window)
        if self._term is None or len(sft) == len(batch):
            return loss
        return loss + self._term(batch, window)


class _PairTerm:
    """The pair loss of one step's micro-batches, and the sums of their metrics."""

    def __init__(self, objective: Objective, reference: Any, trainer, total: int):
        self.objective, self.reference, self.total = objective, reference, total
        self.engine = trainer.engine
        self.gas = int(trainer.engine.gradient_accumulation_steps())
        self.dp_size = trainer.env.dp_size
        self.sums: dict[str, list[float]] = {}

    def __call__(self, batch: dict, window: Window) -> torch.Tensor:
        device = self.engine.device
        pairs = {k[len(PAIR_PREFIX):]: v.to(device) for k, v in batch.items() if k.startswith(PAIR_PREFIX)}
        policy = PreferenceStep._scores(lambda i, m: model_logits(self.engine, i, m), pairs)
        reference = None if self.reference is None else PreferenceStep._scores(self.reference.logits, pairs)
        mean, sums = self.objective.loss(policy, reference, pairs, {})
        for name, (value, count) in sums.items():
            kept = self.sums.setdefault(name, [0.0, 0.0])
            kept[0] += float(value)
            kept[1] += float(count)
        share = (pairs["input_ids"].size(0) // 2) / self.total  # this micro-batch's part of the mean
        if window.num_items is None:  # DeepSpeed divides each micro-batch's loss by gas and dp
            share *= self.gas * self.dp_size
        return mean * share

    def finish(self, env) -> dict[str, float]:
        """The step's metrics over every rank's pairs (collective)."""
        everyone = [self.sums]
        if env.dp_size > 1:
            everyone = [{} for _ in range(env.dp_size)]
            dist.all_gather_object(everyone, self.sums, group=env.dp_group)
        totals: dict[str, list[float]] = {}
        for sums in everyone:
            for name, (value, count) in sums.items():
                kept = totals.setdefault(name, [0.0, 0.0])
                kept[0] += value
                kept[1] += count
        return self.objective.finish({n: v / c for n, (v, c) in totals.items() if c > 0})


def _may_hold_pairs(trainer) -> bool:
    """Whether the run's inbox holds a preference (then a batch may hold one): decided by
    commands every rank runs alike, so every rank answers the same."""
    mixture = getattr(trainer.train_dataset, "mixture", None)
    return mixture is not None and any(s.kind == "inbox" and s.dataset.has_pairs() for s in mixture.sources)


def _sum_over_ranks(value: int, env) -> int:
    if env.dp_size == 1:
        return value
    total = torch.tensor([value], dtype=torch.int64, device=env.device)
    dist.all_reduce(total, group=env.dp_group)
    return int(total.item())


def pairs_problem(trainer) -> str | None:
    """Why this run cannot train a preference pair from the chat, or None. A preference run
    trains it with its objective (kto: as two judged answers); an SFT run with its step's pair
    loss, where the layout and method allow a preference objective at all and the batches are
    the run's own (not a train_fn's or a collate function's given in code)."""
    cfg = trainer.config
    if cfg.preference.objective != "sft":
        return None
    if cfg.method.name in {m.value for m in capabilities.Method}:
        refused = capabilities.problem(capabilities.Layout.of(cfg.parallel.tp_size, cfg.parallel.pp_size),
                                       cfg.method.name, capabilities.Feature.PREFERENCE)
        if refused is not None:
            return f"this SFT run cannot train preference pairs: {refused[1]}"
    if not isinstance(trainer.train_fn, SftStep):
        return "this SFT run cannot train preference pairs: its steps are a train_fn given in code"
    if getattr(getattr(trainer, "data", None), "train_collate_fn", None) is not None:
        return "this SFT run cannot train preference pairs: its batches come from a collate function given in code"
    return None


def step_for(objective: Objective | None, base: StepStrategy, reference: Any = None) -> StepStrategy:
    """The run's step strategy: the preference step for a preference objective; for SFT, the
    engine step that can also train live pairs (SftStep) where `base` is the engine step, else `base`."""
    if objective is not None:
        return PreferenceStep(objective, reference)
    return SftStep() if type(base) is EngineStep else base


def evaluators_for(step: StepStrategy, evaluators: list, max_samples: int = 0) -> list:
    """The run's evaluators: under a preference step, its evaluator in place of perplexity."""
    if not isinstance(step, PreferenceStep):
        return evaluators
    return [PreferenceEvaluator(step, max_samples) if getattr(e, "name", "") == "perplexity" else e
            for e in evaluators]

