"""A GRPO run steered while it trains (docs/rewards.md, "Live"): `set` changes the reward weights
and the sampling and loss settings (`grpo_temperature`, `grpo_beta` ...), `add_reward` and
`remove_reward` change the set of reward functions. Each takes effect at the next step boundary.

What changed is kept in the run's live settings (engine.control.settings.LiveSettings: `grpo`, the
grpo.<name> fields set; `rewards`, the reward entries now), recorded in every checkpoint; `apply`
puts them into the step (engine.objectives.grpo_step.GrpoStep reads `config`, `rewards`, `loss`
and `reference` each step) after a change, on resume and on a rewind, so an exact resume scores
and trains as the first run did. The step's config is replaced by a copy (the run config is never
written); a reward function already loaded is kept (its module is not imported again, so its
state goes on), a new entry is imported and checked with the pre-launch check's words
(contract.rewards.build_reward)."""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist

from contract.protocol.commands import GRPO_SETTINGS, Set
from contract.protocol.reward_commands import AddReward, RemoveReward
from contract.rewards import DEFAULT_REWARDS, Reward, RewardSpecError, build_reward
from engine.control.settings import LiveSettings
from engine.objectives.grpo import GrpoLoss
from engine.objectives.grpo_step import GrpoStep
from engine.objectives.preference_step import AdapterOffReference


class RewardRefused(ValueError):
    """An `add_reward` / `remove_reward` that cannot apply (the same on every rank); nothing changed."""


def step_of(trainer: Any) -> GrpoStep | None:
    """The run's GRPO step, or None (another objective)."""
    step = getattr(trainer, "train_fn", None)
    return step if isinstance(step, GrpoStep) else None


def named(cmd: Set) -> list[str]:
    """The GRPO fields a `set` names (Set's names: grpo_<name>, reward_weights)."""
    fields = [f"grpo_{k}" for k in GRPO_SETTINGS if getattr(cmd, f"grpo_{k}") is not None]
    return fields + (["reward_weights"] if cmd.reward_weights is not None else [])


def problem(trainer: Any, cmd: Set) -> str | None:
    """Why the GRPO fields of `cmd` cannot apply to this run (None: they can)."""
    fields = named(cmd)
    if not fields:
        return None
    step = step_of(trainer)
    if step is None:
        return (f"set: {fields[0]} needs a GRPO run (preference.objective grpo); this run's objective is "
                f"{trainer.config.preference.objective}")
    names = [r.name for r in step.rewards]
    unknown = [n for n in (cmd.reward_weights or {}) if n not in names]
    if unknown:
        return f"set: reward_weights: {unknown[0]!r} is not a reward of this run (its rewards: {', '.join(names)})"
    reusing = _reusing(trainer, step, cmd)
    if reusing:
        return reusing
    if (cmd.grpo_beta or 0) > 0 and step.reference is None and not trainer.method.has_adapter:
        return ("set: grpo_beta needs a reference model, and this run has none: it started with grpo.beta 0 "
                "and trains the whole model (start it with grpo.beta > 0, or train a PEFT adapter, whose "
                "reference is the model without it)")
    return None


# the settings the samples were drawn and scored with: under grpo.num_iterations > 1 the steps that
# train a batch again must keep them (the old log-probabilities were taken with them)
SAMPLED_WITH = ("temperature", "num_generations", "max_completion_length")


def _reusing(trainer: Any, step: GrpoStep, cmd: Set) -> str | None:
    """Why a sampling setting cannot change now: the next step trains the present samples again."""
    iterations, done = step.config.num_iterations, trainer.state.global_step
    given = [f"grpo_{k}" for k in SAMPLED_WITH if getattr(cmd, f"grpo_{k}") is not None]
    if iterations == 1 or done % iterations == 0 or not given:
        return None
    return (f"set: {given[0]}: with grpo.num_iterations {iterations} the next step trains the samples of step "
            f"{done - done % iterations + 1} again, drawn and scored with the present value; send it after step "
            f"{done - done % iterations + iterations} (the next step that samples)")


def record(trainer: Any, live: LiveSettings, cmd: Set) -> None:
    """Keep the GRPO changes of a checked `set` in `live` (`apply` puts them into the step)."""
    live.grpo.update({k: getattr(cmd, f"grpo_{k}") for k in GRPO_SETTINGS if getattr(cmd, f"grpo_{k}") is not None})
    step = step_of(trainer)
    if cmd.reward_weights and step is not None:
        live.rewards = [dict(entry, weight=cmd.reward_weights.get(r.name, r.weight))
                        for r, entry in zip(step.rewards, entries(step))]


def apply(trainer: Any, live: LiveSettings) -> None:
    """Put the kept GRPO settings and rewards into the step: the run's own, the changed ones on
    top (a rewind to before a change gets the run's own back)."""
    step = step_of(trainer)
    if step is None:
        return
    config = trainer.config.grpo.model_copy(update=copy.deepcopy(live.grpo))
    if config != step.config:
        step.config = config
        step.loss = GrpoLoss(config.loss_type, config.epsilon, config.epsilon_high, config.beta,
                             config.max_completion_length)
    if config.beta > 0 and step.reference is None and trainer.method.has_adapter:
        step.reference = AdapterOffReference(trainer.ctx)  # the model without its adapter: no memory
    wanted = live.rewards if live.rewards is not None else (list(trainer.config.grpo.rewards) or list(DEFAULT_REWARDS))
    step.rewards = [_reward(entry, i, step.rewards, config.max_completion_length) for i, entry in enumerate(wanted)]


def current(trainer: Any) -> dict[str, Any]:
    """The GRPO values now, by Set's names (None on another run), and the rewards' entries."""
    step = step_of(trainer)
    values: dict[str, Any] = {f"grpo_{k}": getattr(step.config, k) if step else None for k in GRPO_SETTINGS}
    values["reward_weights"] = {r.name: r.weight for r in step.rewards} if step else None
    values["rewards"] = entries(step) if step else None
    return values


def entries(step: GrpoStep) -> list[dict[str, Any]]:
    """Each reward's entry, with its name and weight (what a checkpoint keeps and `status` shows)."""
    return [{**copy.deepcopy(r.spec), "name": r.name, "weight": r.weight} for r in step.rewards]


# -- add_reward, remove_reward ----------------------------------------------------------------------
def add(trainer: Any, live: LiveSettings, cmd: AddReward, world_size: int) -> list[dict[str, Any]]:
    """Add `cmd.reward` from the next step on; the entries before. Every rank imports and checks
    it; a refusal on any rank is every rank's (RewardRefused)."""
    step = _needs_grpo(trainer, "add_reward")
    error, built = None, None
    try:
        built = build_reward(cmd.reward, "reward", step.config.max_completion_length)
    except RewardSpecError as e:
        error = f"add_reward: {e}"
    error = _agreed(error, world_size)
    if error is not None or built is None:
        raise RewardRefused(error or "add_reward: refused on another rank")
    names = [r.name for r in step.rewards]
    if built.name in names:
        raise RewardRefused(f"add_reward: reward.name: the run already has a reward named {built.name!r} (its "
                            f"rewards: {', '.join(names)}); give the new one another name")
    before = entries(step)
    step.rewards = [*step.rewards, built]  # `apply` keeps it: its entry is now the step's
    live.rewards = entries(step)
    apply(trainer, live)
    return before


def remove(trainer: Any, live: LiveSettings, cmd: RemoveReward) -> list[dict[str, Any]]:
    """Remove the reward named `cmd.reward` from the next step on; the entries before."""
    step = _needs_grpo(trainer, "remove_reward")
    names = [r.name for r in step.rewards]
    if cmd.reward not in names:
        raise RewardRefused(f"remove_reward: reward: {cmd.reward!r} is not a reward of this run (its rewards: "
                            f"{', '.join(names)})")
    if len(names) == 1:
        raise RewardRefused(f"remove_reward: reward: {cmd.reward!r} is the run's only reward, and a step needs "
                            "one; add another first (add_reward)")
    before = entries(step)
    live.rewards = [e for e in before if e["name"] != cmd.reward]
    apply(trainer, live)
    return before


# -- helpers --------------------------------------------------------------------------------------
def _needs_grpo(trainer: Any, what: str) -> GrpoStep:
    step = step_of(trainer)
    if step is None:
        raise RewardRefused(f"{what}: needs a GRPO run (preference.objective grpo); this run's objective is "
                            f"{trainer.config.preference.objective}")
    return step


def _reward(entry: dict[str, Any], index: int, loaded: list[Reward], max_completion_length: int) -> Reward:
    """The reward `entry` declares: a function already loaded for the same target is kept (not
    imported again; name and weight from the entry); a built-in is built again (cheap: a length
    penalty follows max_completion_length); anything else is imported and checked."""
    target = entry.get("function")
    kept = next((r for r in loaded if target is not None and r.spec.get("function") == target), None)
    if kept is not None:
        return Reward(str(entry.get("name") or kept.name), float(entry.get("weight", 1.0)), kept.fn, kept.spec)
    return build_reward(entry, f"grpo.rewards[{index}]", max_completion_length)


def _agreed(error: str | None, world_size: int) -> str | None:
    """The first rank's refusal, on every rank (None: every rank could)."""
    if world_size <= 1 or not dist.is_initialized():
        return error
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, error)
    return next((e for e in everyone if e is not None), None)
