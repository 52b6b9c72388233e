"""The data commands: the run's sources and the inbox of taught answers. Import them
through contract.protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from contract.protocol.roles import Role
from contract.protocol.base import Command, ProtocolError, _arg, check_messages

_FORMATS = ("auto", "text", "input_output", "chat", "tokenized")


def _check_source_name(label: str, source: str, required: bool = True) -> None:
    if (required and not source.strip()) or source != source.strip() or "/" in source:
        raise ProtocolError(f"{label}: argument 'source' must name a source (no '/', no surrounding "
                            f"spaces), got {source!r}")


@dataclass(frozen=True)
class AddSource(Command):
    """Add a training source at the next step boundary: its rows are read and checked like the
    data at start (bad rows are reported by number; an unusable file is refused, nothing changes)."""
    name: ClassVar[str] = "add_source"
    path: str = _arg("", "The file or saved dataset folder (as data.train takes).")
    format: str = _arg("auto", "Row format: auto, text, input_output, chat or tokenized.")
    weight: float = _arg(1.0, "Its weight among the sources (0: added paused).", minimum=0.0, maximum=1e9)
    # `source`, not `name`: `name` is every command's wire name
    source: str = _arg("", "The source's name; default: the file name without its suffix.")

    def _check(self) -> None:
        if not self.path.strip():
            raise ProtocolError("add_source: argument 'path' must name a file or folder")
        if self.format not in _FORMATS:
            raise ProtocolError(f"add_source: argument 'format' must be one of {', '.join(_FORMATS)}, "
                                f"got {self.format!r}")
        _check_source_name(self.label, self.source, required=False)


@dataclass(frozen=True)
class SetWeight(Command):
    """Change a source's weight from the next step on; 0 pauses it."""
    name: ClassVar[str] = "set_weight"
    source: str = _arg("", "The source's name.")
    weight: float = _arg(1.0, "Its new weight (0 pauses it).", minimum=0.0, maximum=1e9)

    def _check(self) -> None:
        _check_source_name(self.label, self.source)


@dataclass(frozen=True)
class RemoveSource(Command):
    """Stop drawing from a source from the next step on (its position stays in the record)."""
    name: ClassVar[str] = "remove_source"
    source: str = _arg("", "The source's name.")

    def _check(self) -> None:
        _check_source_name(self.label, self.source)


@dataclass(frozen=True)
class Teach(Command):
    """Append (the prompt as the model saw it, the corrected answer) to the run's inbox, durably,
    and mix it into the next batches: `per_step` samples in each of the next `steps` batches
    (teach.* in the config by default), and/or the inbox source's `weight`. With `rejected` it is
    a preference: the answer is better than the rejected one (a preference run's pair)."""
    name: ClassVar[str] = "teach"
    answer: str = _arg("", "The answer the model should have given.")
    prompt: str | None = _arg(None, "The prompt, as given to generate (give this or `messages`).")
    messages: list[dict[str, str]] | None = _arg(None, "The chat the answer continues (give this or `prompt`).")
    per_step: int | None = _arg(None, "Samples of it per global batch (default teach.per_step).",
                                minimum=0, maximum=1 << 20)
    steps: int | None = _arg(None, "Batches it is mixed into (default teach.steps).", minimum=0, maximum=1 << 20)
    check_after: int | None = _arg(None, "Steps until the model is asked again (default "
                                   "teach.check_after; 0: never).", minimum=0, maximum=1 << 20)
    weight: float | None = _arg(None, "The inbox source's weight from now on (all its entries, "
                                "round robin); default: left as it is (0 at first).", minimum=0.0, maximum=1e9)
    rejected: str | None = _arg(None, "A worse answer to the same prompt: the pair (answer preferred "
                                "over rejected) trains a preference run (dpo, orpo, simpo) at once.")

    def _check(self) -> None:
        if not self.answer.strip():
            raise ProtocolError("teach: argument 'answer' is empty; write the answer the model should have given")
        if self.rejected is not None and not self.rejected.strip():
            raise ProtocolError("teach: argument 'rejected' is empty; give the worse answer, or leave it out")
        if self.rejected is not None and self.rejected == self.answer:
            raise ProtocolError("teach: 'answer' and 'rejected' are the same answer (nothing to prefer)")
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("teach: give exactly one of `prompt` or `messages`")
        if self.prompt is not None and not self.prompt:
            raise ProtocolError("teach: argument 'prompt' is empty")
        if self.messages is not None:
            check_messages(self.messages)


@dataclass(frozen=True)
class Inbox(Command):
    """The run's inbox: every taught entry, forgotten ones marked."""
    name: ClassVar[str] = "inbox"
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing


@dataclass(frozen=True)
class Forget(Command):
    """Stop training on an inbox entry from the next step on (the file keeps a record of it)."""
    name: ClassVar[str] = "forget"
    id: str = _arg("", "The entry's id (t1, t2, ...; see inbox).")

    def _check(self) -> None:
        if not self.id.strip():
            raise ProtocolError("forget: argument 'id' must name an inbox entry (t1, t2, ...)")
