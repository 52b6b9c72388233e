"""Commands that move the loop (pause, stop, rewind, branch): their handlers return a `Move`, and
the loop carries it out (engine.trainer, `Trainer._act`) before the command is answered.

A handler checks what it can and does what belongs to the control plane (a stop's checkpoint);
what changes the loop's course it hands back as a Signal (engine.callbacks). The control plane
ends the boundary's run of commands there and returns the signal, its `answer` bound to the
command (`Deferred`); the loop acts, then answers through it (`done` with what the act gave, or
`failed`), and the boundary goes on with the commands after it.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from engine.callbacks import Signal
from engine.checkpoint.locations import CheckpointError
from engine.checkpoint.rewind import StateLost
from engine.control.pending import Pending


@dataclass(frozen=True)
class Move:
    """A handler's ask of the loop: `signal`, and `finish(outcome)` giving the command's answer
    from what the loop's act gave (a rewind's RewindResult; None for pause and stop). `what`
    prefixes a refusal (a rewind refused: "rewind: <why>")."""
    signal: Signal
    finish: Callable[[Any], dict]
    what: str


class Answering(Protocol):
    """What the deferred answer uses of the control plane (engine.control.plane.Control)."""

    def answer_done(self, item: Pending, result: dict, seconds: float) -> None: ...
    def answer_error(self, item: Pending, message: str) -> None: ...


class Deferred:
    """The answer of one command that moved the loop, sent once the loop has acted."""

    def __init__(self, plane: Answering, item: Pending, move: Move, started: float):
        self.plane, self.item, self.move, self.started = plane, item, move, started

    def done(self, outcome: Any = None) -> None:
        try:
            result = self.move.finish(outcome)
        except Exception as e:  # noqa: BLE001 - a failed command is answered; training goes on
            traceback.print_exc()
            self.failed(e)
            return
        self.plane.answer_done(self.item, result, round(time.perf_counter() - self.started, 4))

    def failed(self, error: BaseException) -> None:
        if isinstance(error, (CheckpointError, ValueError)):  # refused (or undone) alike on every rank
            message = f"{self.move.what}: {error}"
        elif isinstance(error, StateLost):  # the run ends with this message
            message = f"{self.item.cmd} failed: {error}"
        else:
            message = f"{self.item.cmd} failed: {type(error).__name__}: {error}"
        self.plane.answer_error(self.item, message)
