"""The live settings: what `set` (and `stop`) change while a run goes on. Torch-free.

One object, owned by the run's control plane (`Control.settings`, also `trainer.live_settings`):
the handlers write it, the loop reads it. A field left at None means "as configured": the run
config object is never written, so `trainer.config` stays what the run was started with, and a
resumed run whose config changed a value gets the new value unless `set` changed it live.

Recorded in every training checkpoint (the control callback's state) and applied again on
resume. The stop decision (`final_save`) is not recorded: it belongs to the process that stops.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from contract.config.schema import RunConfig
from contract.protocol.commands import GENERATION_DEFAULTS

# the settings `set` replaces as they are (lr and lr_scale go through the schedule, generation merges)
REPLACED = ("grad_clip", "eval_every_n_steps", "save_every_n_steps", "preference_beta", "serving_budget")
# the typed fields of the optimizer's parameter groups (`set optimizer={...}` names any other);
# they merge into `LiveSettings.optimizer` (engine.control.live_fields applies them)
OPTIMIZER_FIELDS = ("weight_decay", "betas", "eps")


@dataclass
class LiveSettings:
    """The values `set` changed (None: the run config's), and whether `stop` asked for a save."""

    lr_scale: float = 1.0                      # factor on the configured learning-rate schedule
    grad_clip: float | None = None             # None: optim.grad_clip
    eval_every_n_steps: int | None = None      # None: eval.every_n_steps
    save_every_n_steps: int | None = None      # None: checkpoint.every_n_steps
    generation: dict[str, Any] = field(default_factory=dict)  # chat defaults over GENERATION_DEFAULTS
    optimizer: dict[str, Any] = field(default_factory=dict)   # parameter-group fields set live (weight_decay, ...)
    preference_beta: float | None = None       # None: preference.beta
    serving_budget: float | None = None        # None: control.serving_budget
    # a GRPO run's (engine.objectives.grpo_live): the grpo.<name> fields set live (temperature,
    # beta ...), and the reward entries now, weights included (None: grpo.rewards as configured)
    grpo: dict[str, Any] = field(default_factory=dict)
    rewards: list[dict[str, Any]] | None = None
    final_save: bool | None = None             # stop(save=...); None: checkpoint.save_at_end
    # the optimizer's groups as built (engine.control.live_fields.remember): what a field `set`
    # never changed goes back to on a restore; the process's own, never recorded
    configured_groups: list[dict[str, Any]] = field(default_factory=list, compare=False, repr=False)

    # -- what the loop reads ------------------------------------------------------------------
    def eval_every(self, config: RunConfig) -> int:
        """Evaluate every this many steps (0: never)."""
        return config.eval.every_n_steps if self.eval_every_n_steps is None else self.eval_every_n_steps

    def save_every(self, config: RunConfig) -> int:
        """Write a training checkpoint every this many steps (0: never)."""
        return config.checkpoint.every_n_steps if self.save_every_n_steps is None else self.save_every_n_steps

    def save_at_end(self, config: RunConfig) -> bool:
        """Save the final model when training ends (a `stop` decides it for the run it stops)."""
        return config.checkpoint.save_at_end if self.final_save is None else self.final_save

    def generation_params(self, request: dict[str, Any] | None = None) -> dict[str, Any]:
        """The sampling parameters of a chat: the request's, else the run's, else the defaults."""
        return {**GENERATION_DEFAULTS, **self.generation, **(request or {})}

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The changed settings, as stored in training checkpoints (plain values)."""
        state: dict[str, Any] = {"lr_scale": self.lr_scale, "generation": copy.deepcopy(self.generation)}
        state.update({k: getattr(self, k) for k in REPLACED if getattr(self, k) is not None})
        if self.optimizer:
            state["optimizer"] = copy.deepcopy(self.optimizer)
        if self.grpo:
            state["grpo"] = copy.deepcopy(self.grpo)
        if self.rewards is not None:
            state["rewards"] = copy.deepcopy(self.rewards)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the settings a checkpoint recorded (what it does not name goes back to config)."""
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.generation = copy.deepcopy(dict(state.get("generation") or {}))
        self.optimizer = copy.deepcopy(dict(state.get("optimizer") or {}))
        self.grpo = copy.deepcopy(dict(state.get("grpo") or {}))
        rewards = state.get("rewards")
        self.rewards = copy.deepcopy(list(rewards)) if rewards is not None else None
        for key in REPLACED:
            setattr(self, key, state.get(key))


def live_settings(run: Any) -> LiveSettings:
    """The live settings of `run` (a trainer or run context), or unchanged ones when the run has
    no control plane: what the loop calls to read its schedule."""
    settings = getattr(run, "live_settings", None)
    return settings if isinstance(settings, LiveSettings) else LiveSettings()
