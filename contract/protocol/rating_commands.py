"""A person's rating of a GRPO run's answer (docs/rewards.md, "Samples and ratings" and "Rating a
chat answer"), with the answers declared beside them. Import them through
contract.protocol.commands (COMMANDS).

`rate` names a sample as the `samples` event names it: the step that sampled it and its number in
that step. `rate_chat` names an answer the chat gave with the live weights: the prompt (or chat)
as sent to `generate`, the answer's text as it came back, and optionally the step it was answered
at. `score` is up (1), down (-1), or any score in [-1, 1], for both."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from contract.protocol.answers import Answer, Stepped
from contract.protocol.base import Chat, Command

UP, DOWN = 1.0, -1.0  # the scores of a thumbs up and a thumbs down
SCORE_HELP = "The rating: up (1), down (-1), or any score in between."


def up_or_down(score: Any) -> Any:
    """A box's text as a score: " Up" -> 1, "down " -> -1, "0.5" -> "0.5" (pydantic parses it)."""
    if not isinstance(score, str):
        return score
    word = score.strip().lower()
    return {"up": UP, "down": DOWN}.get(word, word)


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
    score: float = Field(ge=-1.0, le=1.0, description=SCORE_HELP)

    @field_validator("score", mode="before")
    @classmethod
    def _up_or_down(cls, score: Any) -> Any:
        return up_or_down(score)


class RateChatAnswer(Stepped):
    id: str = Field(description="The rating's inbox entry (forget it to take it back).")
    answer_step: int = Field(description="The step the rated chat answer was given at.")
    score: float
    group_size: int = Field(description="The group it trains in: the rated answer and group_size - 1 fresh "
                            "samples of the same prompt (grpo.num_generations now).")
    applies_from_step: int = Field(description="The step that samples and trains the group.")


class RateChat(Command):
    """Rate an answer the chat gave with this GRPO run's live weights: the next step samples
    grpo.num_generations - 1 fresh answers to the same prompt and trains them with the rated one
    as one more group, with a `human` reward (the rated answer gets `score`, the fresh ones 0).
    Written durably to the run's inbox before the answer; `forget` takes it back."""
    name: ClassVar[str] = "rate_chat"
    returns: ClassVar[type[Answer]] = RateChatAnswer
    answer: str = Field(description="The chat answer's text, as generate returned it.")
    prompt: str | None = Field(default=None, description="The prompt, as given to generate (give this or `messages`).")
    messages: Chat | None = Field(default=None, description="The chat, as given to generate (give this or `prompt`).")
    step: int | None = Field(default=None, ge=0, le=2**63 - 1, description="The step the answer was given at "
                             "(generate's `step`); none: the latest such answer.")
    score: float = Field(ge=-1.0, le=1.0, description=SCORE_HELP)

    @field_validator("score", mode="before")
    @classmethod
    def _up_or_down(cls, score: Any) -> Any:
        return up_or_down(score)

    @model_validator(mode="after")
    def _an_answer_to_a_prompt(self) -> RateChat:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages` (as sent to generate)")
        return self
