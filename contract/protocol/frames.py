"""The messages a run sends back on its control socket, one JSON object per line: a model per
kind, so a frame is built with its fields checked where it is made (engine.control.pending,
.connection, .server, .completions) and read as one model where it arrives (supervisor.connection
parses each line once; the client and the OpenAI stream read fields, never keys).

    ack    a queued command was taken (`queued`: commands before it)
    token  a piece of a streamed answer (`model`: current or base; a completion's step and seed)
    done   the command's answer (`result`: its contract.protocol.answers model's JSON)
    error  the command was refused or failed (`lost`: the connection went before the answer)
    event  one line of the run's events.jsonl (`line`: its number)

The wire stays plain JSON (`frame.wire()`), so a client of another language reads it as before."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from contract.protocol.base import ProtocolError


class Frame(BaseModel):
    """One message to a client; `id` names the request it answers (None: the connection's)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str | None = None

    def wire(self) -> dict[str, Any]:
        """The JSON object sent: every field but optional ones left unset (`id` always)."""
        return self.model_dump(mode="json", exclude_none=True) | {"id": self.id}

    def to(self, req_id: str | None) -> Frame:
        """The same frame addressed to request `req_id`."""
        return self.model_copy(update={"id": req_id})


class Ack(Frame):
    type: Literal["ack"] = "ack"
    queued: int = Field(ge=0, description="Commands waiting before this one.")


class Token(Frame):
    type: Literal["token"] = "token"
    text: str
    model: Literal["current", "base"] = "current"
    step: int | None = Field(default=None, description="The step that answers (completions).")
    seed: int | None = Field(default=None, description="The seed that samples it (completions).")


class Done(Frame):
    type: Literal["done"] = "done"
    result: dict[str, Any] = Field(description="The command's answer model, as JSON.")


class Error(Frame):
    type: Literal["error"] = "error"
    message: str
    lost: bool | None = Field(default=None, description="The connection was lost before the answer "
                              "(said by the client's side, never by the run).")


class EventLine(Frame):
    type: Literal["event"] = "event"
    line: int = Field(ge=0, description="The event's line number in events.jsonl.")
    event: dict[str, Any]


AnyFrame = Annotated[Union[Ack, Token, Done, Error, EventLine], Field(discriminator="type")]
FRAMES: TypeAdapter[Frame] = TypeAdapter(AnyFrame)


def parse_frame(message: Any) -> Frame:
    """A decoded line as its frame model; a line that is no frame is a ProtocolError."""
    try:
        return FRAMES.validate_python(message)
    except ValidationError as e:
        raise ProtocolError(f"not a message of the control protocol: {e.errors()[0]['msg']}") from None


def event_frame_bytes(line: int, raw: bytes) -> bytes:
    """An `event` frame built around an events.jsonl line as it is on disk (already JSON: the feed
    of a long backlog does not decode and encode each event again); parse_frame reads it as an
    EventLine (tests/test_protocol.py)."""
    return b'{"type": "event", "id": null, "line": %d, "event": %s}\n' % (line, raw)
