"""The data commands: the run's sources and the inbox of taught answers. Import them
through contract.protocol."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from contract.protocol.answers import (AddSourceAnswer, Answer, ForgetAnswer, InboxAnswer, SetWeightAnswer,
                                       SourcesAnswer, TeachAnswer)
from contract.protocol.roles import Role
from contract.protocol.base import Chat, Command


def _source_name(source: str, required: bool = True) -> str:
    if (required and not source.strip()) or source != source.strip() or "/" in source:
        raise ValueError(f"argument 'source' must name a source (no '/', no surrounding spaces), got {source!r}")
    return source


SourceFormat = Literal["auto", "text", "input_output", "chat", "tokenized"]
SourceName = Annotated[str, AfterValidator(_source_name)]
# add_source's: empty names the source after its file
NewSourceName = Annotated[str, AfterValidator(lambda source: _source_name(source, required=False))]


class AddSource(Command):
    """Add a training source at the next step boundary: its rows are read and checked like the
    data at start (bad rows are reported by number; an unusable file is refused, nothing changes)."""
    name: ClassVar[str] = "add_source"
    returns: ClassVar[type[Answer]] = AddSourceAnswer
    path: str = Field(description="The file or saved dataset folder (as data.train takes).")
    format: SourceFormat = Field(
        default="auto", description="Row format: auto, text, input_output, chat or tokenized.")
    weight: float = Field(default=1.0, ge=0.0, le=1e9, description="Its weight among the sources (0: added paused).")
    # `source`, not `name`: `name` is every command's wire name
    source: NewSourceName = Field(default="", description="The source's name; default: the file name without "
                                  "its suffix.")

    @field_validator("path")
    @classmethod
    def _a_path(cls, path: str) -> str:
        if not path.strip():
            raise ValueError("argument 'path' must name a file or folder")
        return path


class SetWeight(Command):
    """Change a source's weight from the next step on; 0 pauses it."""
    name: ClassVar[str] = "set_weight"
    returns: ClassVar[type[Answer]] = SetWeightAnswer
    source: SourceName = Field(description="The source's name.")
    weight: float = Field(default=1.0, ge=0.0, le=1e9, description="Its new weight (0 pauses it).")


class RemoveSource(Command):
    """Stop drawing from a source from the next step on (its position stays in the record)."""
    name: ClassVar[str] = "remove_source"
    returns: ClassVar[type[Answer]] = SourcesAnswer
    source: SourceName = Field(description="The source's name.")


class Teach(Command):
    """Append (the prompt as the model saw it, the corrected answer) to the run's inbox, durably,
    and mix it into the next batches: `per_step` samples in each of the next `steps` batches
    (teach.* in the config by default), and/or the inbox source's `weight`. With `rejected` it is
    a preference: the answer is better than the rejected one (a preference run's pair)."""
    name: ClassVar[str] = "teach"
    returns: ClassVar[type[Answer]] = TeachAnswer
    answer: str = Field(description="The answer the model should have given.")
    prompt: str | None = Field(default=None, description="The prompt, as given to generate (give this or `messages`).")
    messages: Chat | None = Field(default=None, description="The chat the answer continues (give this or `prompt`).")
    per_step: int | None = Field(default=None, ge=0, le=1 << 20, description="Samples of it per global batch (default "
                                 "teach.per_step).")
    steps: int | None = Field(default=None, ge=0, le=1 << 20, description="Batches it is mixed into (default "
                              "teach.steps).")
    check_after: int | None = Field(default=None, ge=0, le=1 << 20, description="Steps until the model is asked again "
                                    "(default teach.check_after; 0: never).")
    weight: float | None = Field(default=None, ge=0.0, le=1e9, description="The inbox source's weight from now on (all "
                                 "its entries, round robin); default: left as it is (0 at first).")
    rejected: str | None = Field(default=None, description="A worse answer to the same prompt: the pair (answer "
                                 "preferred over rejected) trains from the next step with the run's objective "
                                 "(kto: two judged answers; sft: the answer plus preference.sft_pairs' loss).")

    @model_validator(mode="after")
    def _an_answer_to_a_prompt(self) -> Teach:
        if not self.answer.strip():
            raise ValueError("argument 'answer' is empty; write the answer the model should have given")
        if self.rejected is not None and not self.rejected.strip():
            raise ValueError("argument 'rejected' is empty; give the worse answer, or leave it out")
        if self.rejected is not None and self.rejected == self.answer:
            raise ValueError("'answer' and 'rejected' are the same answer (nothing to prefer)")
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        if self.prompt is not None and not self.prompt:
            raise ValueError("argument 'prompt' is empty")
        return self


class Inbox(Command):
    """The run's inbox: every taught entry, forgotten ones marked."""
    name: ClassVar[str] = "inbox"
    returns: ClassVar[type[Answer]] = InboxAnswer
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing


class Forget(Command):
    """Stop training on an inbox entry from the next step on (the file keeps a record of it)."""
    name: ClassVar[str] = "forget"
    returns: ClassVar[type[Answer]] = ForgetAnswer
    id: str = Field(description="The entry's id (t1, t2, ...; see inbox).")

    @field_validator("id")
    @classmethod
    def _an_entry(cls, entry: str) -> str:
        if not entry.strip():
            raise ValueError("argument 'id' must name an inbox entry (t1, t2, ...)")
        return entry
