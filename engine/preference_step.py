"""The step strategy of a preference objective, and the reference model it compares with.

`PreferenceStep` is chosen once at assembly (`step_for`) in place of the engine step when
`preference.objective` is not sft. For each micro-batch: the policy's forward through the
DeepSpeed engine (chosen and rejected rows in one batch), the reference's forward without
gradient where the objective needs one, the objective's loss (engine.objectives), the engine's
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
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.objectives import Objective, Scores, scores_of
from engine.steps import StepStrategy

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, attention_mask) -> logits


def _logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


class AdapterOffReference:
    """The policy with its PEFT adapter disabled."""

    def __init__(self, run):
        self.run = run

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        engine = self.run.engine
        with torch.no_grad(), self.run.method.base_model(engine.module):
            return _logits(engine, input_ids, attention_mask)


class FrozenReference:
    """A frozen copy of the initial model (a module, or a DeepSpeed engine under ZeRO-3)."""

    def __init__(self, model):
        self.model = model

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return _logits(self.model, input_ids, attention_mask)


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
            per_batch.append(_reduce(sums, trainer.env))
        self.metrics = self.objective.finish(_mean_present(per_batch))
        return torch.stack(losses).mean(), tokens

    def micro_batch(self, engine, batch: dict) -> tuple[torch.Tensor, dict]:
        """The loss and the metric sums of one micro-batch (forwards in TRL's order)."""
        extra: dict[str, Scores] = {}
        if self.objective.kl_rows:
            with torch.no_grad():
                extra["policy_kl"] = self._scores(lambda i, m: _logits(engine, i, m), batch, "kl_")
        policy = self._scores(lambda i, m: _logits(engine, i, m), batch)
        reference = None
        if self.objective.needs_reference:
            if self.objective.kl_rows:
                extra["reference_kl"] = self._scores(self.reference.logits, batch, "kl_")
            reference = self._scores(self.reference.logits, batch)
        return self.objective.loss(policy, reference, batch, extra)

    @staticmethod
    def _scores(forward: Forward, batch: dict, prefix: str = "") -> Scores:
        ids, mask = batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"]
        return scores_of(forward(ids, mask), ids, batch[f"{prefix}labels"], mask)


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
            per_batch.append(_reduce(sums, trainer.env))
        if not losses:
            return {}
        mean = _reduce({"loss": (torch.tensor(sum(losses)), torch.tensor(float(len(losses))))}, trainer.env)
        return {**mean, **self.step.objective.finish(_mean_present(per_batch))}


def _reduce(sums: dict, env) -> dict[str, float]:
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


def _mean_present(values: list[dict[str, float]]) -> dict[str, float]:
    """A step's metric: the mean over its micro-batches that have it (TRL logs the same)."""
    names = dict.fromkeys(k for v in values for k in v)
    return {n: sum(v[n] for v in values if n in v) / sum(1 for v in values if n in v) for n in names}


def step_for(objective: Objective | None, base: StepStrategy, reference: Any = None) -> StepStrategy:
    """The run's step strategy: the preference step for a preference objective, else `base`."""
    return base if objective is None else PreferenceStep(objective, reference)


def evaluators_for(step: StepStrategy, evaluators: list, max_samples: int = 0) -> list:
    """The run's evaluators: under a preference step, its evaluator in place of perplexity."""
    if not isinstance(step, PreferenceStep):
        return evaluators
    return [PreferenceEvaluator(step, max_samples) if getattr(e, "name", "") == "perplexity" else e
            for e in evaluators]

