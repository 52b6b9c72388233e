"""Answers for the control-server tests whose boundary thread is a stand-in for the engine: each
is a real contract.protocol.answers model (rank 0 refuses to send an answer that does not fit its
command's declaration). Not a test module."""

from __future__ import annotations

from contract.protocol.answers import Answer, GenerateAnswer, SetAnswer, StateAnswer, StopAnswer
from contract.protocol.commands import Generate, Set, Stop
from contract.protocol.states import RunState


def status(step: int = 7) -> dict:
    """A status snapshot with every declared field (engine.control.plane's has the same)."""
    return {"step": step, "epoch": 0, "state": RunState.RUNNING.value, "paused": False, "queue": 0,
            "accepting": True, "settings": {}, "world_size": 1, "memory_mb": {"0": {"rss": 1.0}},
            "memory_of": "rank 0 only"}


def answer(item, step: int = 7, text: str = "hello") -> Answer:
    """What the stand-in boundary answers a queued command (engine.control.pending.Pending)."""
    command = item.command
    if isinstance(command, Set):  # the changes as asked
        return SetAnswer(step=step, changes=command.args(), applies_from_step=step + 1)
    if isinstance(command, Generate):
        return GenerateAnswer(step=step, text=text)
    if isinstance(command, Stop):
        return StopAnswer(step=step, state=RunState.STOPPING, final_model=command.save)
    return StateAnswer(step=step, state=RunState.PAUSED)
