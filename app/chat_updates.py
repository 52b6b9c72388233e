"""A streamed answer of the live model as the text so far: what the web app's and the notebook's
chat views show while it comes (app.session.Session.chat yields these). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from supervisor.client import Generation


@dataclass(frozen=True)
class ChatUpdate:
    """A streamed answer so far; `step` is set once it is complete (the step it came from)."""
    text: str
    base: str | None
    step: int | None
    note: str | None = None

    @property
    def done(self) -> bool:
        return self.step is not None


def chat_updates(generation: Generation, compare_base: bool = False) -> Iterator[ChatUpdate]:
    """A streamed answer as the text so far, chunk by chunk; the last update is `done` and
    carries the step the answer came from."""
    text, base = "", ""
    for chunk in generation:
        if chunk.model == "base":
            base += chunk
        else:
            text += chunk
        yield ChatUpdate(text, base if compare_base else None, None)
    answer = generation.wait()  # contract.protocol.answers.GenerateAnswer
    yield ChatUpdate(answer.text, answer.base if compare_base else None, answer.step, answer.note)
