"""The live settings that live in the run's parts rather than in the loop's schedule: the fields of
the optimizer's parameter groups (weight decay, Adam's betas and eps, any other), the preference
objective's beta, the serving budget, and a GRPO run's sampling and loss settings and reward
weights (engine.objectives.grpo_live). `set` checks them here, the handlers apply them here
(after a `set`, on resume, on a rewind), and the status shows them from here.

A field `set` has not changed is the run's own: the values the parameter groups had when the
control plane was built (`remember`), the run config's beta and budget. DeepSpeed's ZeRO optimizers
do not restore their groups' fields from a checkpoint, so every restore puts the whole set of
fields back (the run's own, then the changed ones on top): a rewind to a state from before a
`set weight_decay` trains with the run's weight decay again, exactly.

Biases and norm weights (the group `make_optimizer` marks `decay: False`) keep no weight decay.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from contract.config.preference_checks import sft_pair_loss
from contract.protocol.commands import Set
from engine.control.settings import OPTIMIZER_FIELDS, LiveSettings
from engine.objectives import grpo_live

# fields of a parameter group that are not the optimizer's settings (lr moves through the schedule)
NOT_SETTABLE = frozenset({"params", "lr", "initial_lr", "decay", "step", "name"})


def groups_of(trainer: Any) -> list[dict]:
    """The optimizer's parameter groups (the engine's, through its ZeRO wrapper; LOMO's own)."""
    optimizer = getattr(trainer, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None)
    return list(groups) if groups else []


def remember(trainer: Any, live: LiveSettings) -> None:
    """Keep the groups' fields as built: the values a field `set` never changed goes back to."""
    live.configured_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k not in NOT_SETTABLE}
                              for g in groups_of(trainer)]


def optimizer_changes(cmd: Set) -> dict[str, Any]:
    """The parameter-group fields a `set` names (the typed ones and `optimizer`'s)."""
    changes = dict(cmd.optimizer or {})
    changes.update({k: getattr(cmd, k) for k in OPTIMIZER_FIELDS if getattr(cmd, k) is not None})
    return changes


def record(trainer: Any, live: LiveSettings, cmd: Set) -> None:
    """Keep what a checked `set` changes of the run's parts in `live` (`apply` puts it in)."""
    live.optimizer.update(optimizer_changes(cmd))
    grpo_live.record(trainer, live, cmd)


def problem(trainer: Any, live: LiveSettings, cmd: Set) -> str | None:
    """Why `cmd` cannot apply to this run (None: it can); every rank answers alike."""
    refused = grpo_live.problem(trainer, cmd)
    if refused:
        return refused
    changes = optimizer_changes(cmd)
    if changes:
        groups = groups_of(trainer)
        if not groups:
            return "set: this run's optimizer has no parameter groups whose fields could change"
        fields = sorted(k for k in groups[0] if k not in NOT_SETTABLE)
        name = type(_base_optimizer(trainer)).__name__
        for key, value in changes.items():
            if key in NOT_SETTABLE or key not in groups[0]:
                why = "is set through lr / lr_scale" if key in ("lr", "initial_lr") else "is not one of its fields"
                return f"set: {key} {why} ({name}'s fields: {', '.join(fields)})"
            kind = _shape(groups[0][key])
            if kind != _shape(value):
                return f"set: {key} of {name} is {kind}, got {value!r}"
        own_rules = _own_rules(trainer, changes)
        if own_rules:
            return own_rules
    if cmd.preference_beta is not None and _beta(trainer) is None:
        return ("set: preference_beta needs a preference objective with a beta (dpo, simpo, kto, or an "
                "SFT run's live pairs with preference.sft_pairs dpo or simpo)")
    return None


def apply(trainer: Any, live: LiveSettings, serving: Any) -> None:
    """Put the fields into the run's parts: the run's own values, the changed ones on top."""
    changed = live.optimizer
    configured = live.configured_groups
    for i, group in enumerate(groups_of(trainer)):
        own = configured[i] if i < len(configured) else {}
        for key, value in {**own, **changed}.items():
            if key not in group:
                continue
            if key == "weight_decay" and group.get("decay") is False:
                value = 0.0  # biases and norm weights never decay
            group[key] = tuple(value) if isinstance(group[key], tuple) else copy.deepcopy(value)
    objective = _objective(trainer, create=live.preference_beta is not None)
    if objective is not None:
        objective.beta = live.preference_beta if live.preference_beta is not None else trainer.config.preference.beta
    if serving is not None:
        serving.share = (live.serving_budget if live.serving_budget is not None
                         else trainer.config.control.serving_budget)
    grpo_live.apply(trainer, live)


def current(trainer: Any, serving: Any) -> dict[str, Any]:
    """The values now, as the status and the `set` events show them."""
    groups = groups_of(trainer)
    decaying = next((g for g in groups if g.get("decay") is not False), groups[0] if groups else {})
    fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in decaying.items() if k not in NOT_SETTABLE}
    return {"weight_decay": fields.get("weight_decay"), "betas": fields.get("betas"), "eps": fields.get("eps"),
            "optimizer": fields, "preference_beta": _beta(trainer),
            "serving_budget": getattr(serving, "share", None), **grpo_live.current(trainer)}


# -- helpers --------------------------------------------------------------------------------------
def _base_optimizer(trainer: Any) -> Any:
    """The optimizer under DeepSpeed's wrappers (ZeRO, bf16): the class whose rules apply."""
    optimizer = getattr(trainer, "optimizer", None)
    while hasattr(optimizer, "optimizer") and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    return optimizer


def _shape(value: Any) -> str:
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} numbers"
    return type(value).__name__


def _own_rules(trainer: Any, changes: dict[str, Any]) -> str | None:
    """The optimizer class's own checks (torch's check their arguments as they are built): build
    one over a scratch tensor with the group's fields and the changes; its refusal is ours."""
    import torch  # the engine's; kept here so the module's checks above stay importable without it

    base = _base_optimizer(trainer)
    cls = type(base)
    if not (isinstance(base, torch.optim.Optimizer) and cls.__module__.startswith("torch.optim")):
        return None  # DeepSpeed's and LOMO's own optimizers: the contract's rules only
    accepted = inspect.signature(cls.__init__).parameters
    group = groups_of(trainer)[0]
    kwargs = {k: v for k, v in {**group, **changes}.items() if k in accepted and k not in NOT_SETTABLE}
    try:
        cls([torch.zeros(1, requires_grad=True)], lr=0.0, **kwargs)
    except (ValueError, TypeError) as e:
        return f"set: {', '.join(sorted(changes))}: {cls.__name__} refuses it: {e}"
    return None


def _objective(trainer: Any, create: bool) -> Any:
    """The preference objective whose beta `set preference_beta` changes, or None. An SFT run's
    pair objective is made at its first pair; `create` makes it now (from the run config)."""
    step = getattr(trainer, "train_fn", None)
    objective = getattr(step, "objective", None)
    if objective is None and create and _pairs_have_beta(trainer):
        from engine.objectives.preference import sft_pair_objective  # torch: only for an SFT run's pairs

        objective = step.objective = sft_pair_objective(trainer.config)
    return objective if hasattr(objective, "beta") else None


def _pairs_have_beta(trainer: Any) -> bool:
    """An SFT run whose live pairs train with a loss that has a beta (DPO, SimPO)."""
    step = getattr(trainer, "train_fn", None)
    return hasattr(step, "objective") and sft_pair_loss(trainer.config) in ("dpo", "simpo")


def _beta(trainer: Any) -> float | None:
    objective = _objective(trainer, create=False)
    if objective is not None:
        return float(objective.beta)
    return float(trainer.config.preference.beta) if _pairs_have_beta(trainer) else None
