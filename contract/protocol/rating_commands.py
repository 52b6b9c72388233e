"""A person's rating of a GRPO run's sample (docs/rewards.md, "Samples and ratings"), with its
answer declared beside it. Import it through contract.protocol.commands (COMMANDS).

The sample is named as the `samples` event names it: the step that sampled it and its number in
that step. `score` is up (1), down (-1), or any score in [-1, 1]."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from contract.protocol.answers import Answer, Stepped
from contract.protocol.base import Command

UP, DOWN = 1.0, -1.0  # the scores of a thumbs up and a thumbs down


class RateAnswer(Stepped):
    id: str = Field(description="The rating's inbox entry (forget it to take it back).")
    sample_step: int = Field(description="The step that sampled the rated answer.")
    sample: int = Field(description="The rated sample's number in that step.")
    group: int = Field(description="Its group (prompt) in that step: the group trained again.")
    score: float
    applies_from_step: int = Field(description="The step that trains the group with the rating.")


class Rate(Command):
    """Rate a sample of a GRPO run: its group is trained once more at the next step, as one more
    group, with a `human` reward (the rated answer gets `score`, the group's others none).
    Written durably to the run's inbox before the answer; `forget` takes it back."""
    name: ClassVar[str] = "rate"
    returns: ClassVar[type[Answer]] = RateAnswer
    step: int = Field(ge=1, le=2**63 - 1, description="The step that sampled it (the samples event's step).")
    sample: int = Field(ge=0, le=1 << 30, description="Its number in that step (the samples event's `number`).")
    score: float = Field(ge=-1.0, le=1.0, description="The rating: up (1), down (-1), or any score in between.")

    @field_validator("score", mode="before")
    @classmethod
    def _up_or_down(cls, score: Any) -> Any:
        if not isinstance(score, str):
            return score
        word = score.strip().lower()  # a box's text: " Up", "down ", "0.5"
        return {"up": UP, "down": DOWN}.get(word, word)
