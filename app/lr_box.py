"""The learning-rate box of the web page and of the notebook panel: one rule, from the Set command
(contract.protocol.commands.Set: its `lr` bounds and words). A number the command takes is sent;
0 stops learning, so a box sends it only when the user confirmed it (the page asks; the panel
cannot ask, so it refuses, and `run.set(lr=0)` does it on purpose); anything else is refused with
a sentence (app.session.SessionError)."""

from __future__ import annotations

from typing import Any

from app.session import SessionError
from contract.protocol.base import ProtocolError
from contract.protocol.commands import Set

ZERO = "set lr: 0 stops learning; the box sends it only when confirmed (on purpose, from code: run.set(lr=0))"


def lr_from_box(text: Any, confirmed: bool = False) -> Set:
    """The Set command the box's `text` asks for; a SessionError with the command's words if it
    is not a learning rate the command takes, or 0 not `confirmed`."""
    shown = "" if text is None else str(text).strip()
    if not shown:
        raise SessionError("set lr: type a learning rate first (a number, e.g. 0.001)")
    try:
        value = float(shown)
    except ValueError:
        raise SessionError(f"set lr: the learning rate must be a number, got {shown!r}") from None
    try:
        command = Set(lr=value)
    except ProtocolError as e:  # its bounds, not-a-number, infinity: the command's own words
        raise SessionError(str(e)) from None
    if value == 0 and not confirmed:
        raise SessionError(ZERO)
    return command
