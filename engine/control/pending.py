"""Requests waiting for the next step boundary, and the replies that go back to their senders.

Torch-free and thread-safe: the server's connection threads put requests in, the training
thread takes them all out at a boundary. A request is never dropped: it is either executed or,
when the run can no longer execute it, answered with an error that says why.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import ValidationError

from contract.protocol.answers import Answer
from contract.protocol.base import Command
from contract.protocol.commands import command_from_wire
from contract.protocol.frames import Ack, Done, Error, Frame, Token

Sink = Callable[[dict], None]


class Reply:
    """The way back to one request's sender. Sending never raises: a client that went away must
    not make one rank fail a collective command that the others complete. `returns`: the
    command's answer model (contract.protocol.answers), which `done` builds and sends."""

    def __init__(self, req_id: str, sink: Sink | None, returns: type[Answer] = Answer):
        self.id, self._sink, self.finished, self.returns = req_id, sink, False, returns

    def send(self, frame: Frame) -> None:
        if self._sink is None:
            return
        try:
            self._sink(frame.to(self.id).wire())
        except Exception:  # noqa: BLE001 - the sender is gone; the command still completes
            self._sink = None

    def ack(self, queued: int) -> None:
        self.send(Ack(queued=queued))

    def token(self, text: str, model: str = "current", step: int | None = None, seed: int | None = None) -> None:
        self.send(Token(text=text, model=model, step=step, seed=seed))

    def done(self, result: Answer | dict) -> None:
        """Answer with the command's answer model, built here from a handler's result (a result
        that does not fit the declaration is answered as an error: never half an answer)."""
        self.finished = True
        if self._sink is None:  # the other ranks answer nobody: nothing to build
            return
        try:
            answer = result if isinstance(result, self.returns) else self.returns.model_validate(result)
        except ValidationError as e:
            return self.error(f"the run's answer does not fit {self.returns.__name__}: {e}")
        self.send(Done(result=answer.wire()))

    def error(self, message: str) -> None:
        self.finished = True
        self.send(Error(message=message))


NO_REPLY = Reply("", None)  # the other ranks execute commands but answer nobody


@dataclass
class Pending:
    """A queued command: its place in the queue, its request id, the command, its reply."""
    seq: int
    id: str
    command: Command
    reply: Reply = field(repr=False)

    @property
    def cmd(self) -> str:
        """The command's wire name."""
        return self.command.name

    @property
    def args(self) -> dict[str, Any]:
        """The command's wire arguments (what the event log records)."""
        return self.command.args()

    def wire(self) -> dict[str, Any]:
        """What is broadcast to the other ranks (JSON: plain values only)."""
        return {"seq": self.seq, "id": self.id, **self.command.to_wire()}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "Pending":
        """A command broadcast by rank 0, on another rank (which answers nobody)."""
        return cls(data["seq"], data["id"], command_from_wire(data["cmd"], data["args"]), NO_REPLY)


class QueueClosed(RuntimeError):
    pass


class CommandQueue:
    """FIFO of pending commands; `wait` lets a paused rank 0 sleep until one arrives."""

    def __init__(self) -> None:
        self._items: deque[Pending] = deque()
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._closed: str | None = None

    def put(self, req_id: str, command: Command, reply: Reply) -> Pending:
        """Queue a command and acknowledge it (under the lock, so acks count in order)."""
        with self._cond:
            if self._closed is not None:
                raise QueueClosed(self._closed)
            item = Pending(next(self._seq), req_id, command, reply)
            self._items.append(item)
            reply.ack(len(self._items))
            self._cond.notify_all()
        return item

    def drain(self, hold: Callable[[Pending], bool] | None = None) -> list[Pending]:
        """Every queued command, except those `hold` keeps queued (in their order)."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            if hold is not None:
                held = [hold(p) for p in items]
                self._items.extend(p for p, h in zip(items, held) if h)
                items = [p for p, h in zip(items, held) if not h]
        return items

    def wait(self, timeout: float) -> None:
        """Return when a command is queued, or after `timeout` seconds."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)

    def close(self, reason: str) -> None:
        """Refuse new commands from now on with `reason`; queued ones stay for a last drain."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()

    def reopen(self) -> None:
        with self._cond:
            self._closed = None

    @property
    def closed(self) -> str | None:
        return self._closed

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
