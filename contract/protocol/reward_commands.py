"""The reward commands of a GRPO run (docs/rewards.md, "Live"): add a reward function while it
trains, or remove one, from the next step on. Their answer is declared beside them. Import them
through contract.protocol.commands (COMMANDS).

An added entry is checked here for its shape (contract.rewards.check_entry: kind or function,
known keys, a finite weight), where the command is built, so a front end refuses a misspelt key
before anything is sent; the run imports a `function` and checks its signature at the boundary,
on every rank, with the words of the pre-launch check (contract.rewards.build_reward)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from contract.protocol.answers import JSON, Answer, Stepped
from contract.protocol.base import Command
from contract.rewards import RewardSpecError, check_entry


class RewardsAnswer(Stepped):
    rewards: list[JSON] = Field(description="The run's reward functions now, each its entry with its name and "
                                "weight.")
    applies_from_step: int = Field(description="The first step scored with them.")


class AddReward(Command):
    """Add a reward function to a GRPO run from the next step on: an entry as `grpo.rewards` takes
    one (a built-in kind, or `module:function` / `file.py:function`); a function that does not
    import or lacks TRL's signature is refused, naming it."""
    name: ClassVar[str] = "add_reward"
    returns: ClassVar[type[Answer]] = RewardsAnswer
    reward: dict[str, Any] = Field(description="A grpo.rewards entry: {kind: exact_match|regex|format|numeric|"
                                   "length, ...} or {function: module:function}, with an optional name and weight.")

    @field_validator("reward")
    @classmethod
    def _an_entry(cls, reward: dict[str, Any]) -> dict[str, Any]:
        try:
            check_entry(reward, "reward")
        except RewardSpecError as e:
            raise ValueError(f"argument {e}") from None
        return reward


class RemoveReward(Command):
    """Stop scoring with one of a GRPO run's reward functions from the next step on (the last one
    stays: a step needs a reward)."""
    name: ClassVar[str] = "remove_reward"
    returns: ClassVar[type[Answer]] = RewardsAnswer
    # `reward`, not `name`: `name` is every command's wire name
    reward: str = Field(min_length=1, description="The reward's name (its metrics' rewards/<name>/...).")
