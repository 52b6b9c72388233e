"""Answers for the control-server tests whose boundary thread is a stand-in for the engine: each
is a real contract.protocol.answers model (rank 0 refuses to send an answer that does not fit its
command's declaration). Not a test module."""

from __future__ import annotations

from contract.protocol.answers import (Answer, BranchesAnswer, CompleteAnswer, GenerateAnswer, InboxAnswer, SetAnswer,
                                       StateAnswer, StatusAnswer, StopAnswer)
from contract.protocol.branch_commands import Branches
from contract.protocol.commands import Generate, Set, Stop
from contract.protocol.completion_commands import Complete
from contract.protocol.data_commands import Inbox
from contract.protocol.states import RunState


def status(step: int = 7) -> StatusAnswer:
    """A status snapshot (the model engine.control.plane's status_snapshot builds)."""
    return StatusAnswer(step=step, epoch=0, state=RunState.RUNNING, paused=False, queue=0, accepting=True,
                        settings={}, world_size=1, memory_mb={"0": {"rss": 1.0}}, memory_of="rank 0 only")


def answer(item, step: int = 7, text: str = "hello") -> Answer:
    """What the stand-in boundary answers a queued command (engine.control.pending.Pending)."""
    command = item.command
    if isinstance(command, Set):  # the changes as asked
        return SetAnswer(step=step, changes=command.args(), applies_from_step=step + 1)
    if isinstance(command, Generate):
        return GenerateAnswer(step=step, text=text)
    if isinstance(command, Stop):
        return StopAnswer(step=step, state=RunState.STOPPING, final_model=command.save)
    if isinstance(command, Complete):  # one sample per prompt, cut at its length
        return CompleteAnswer(step=step, seed=0, choices=[{"index": 0, "text": text, "finish_reason": "length",
                                                           "logprobs": None}],
                              usage={"prompt_tokens": 1, "completion_tokens": 2})
    if isinstance(command, Branches):
        return BranchesAnswer(step=step, current="main", tree={}, checkpoints={}, snapshots=[], snapshot_details=[])
    if isinstance(command, Inbox):
        return InboxAnswer(step=step, entries=[], sources=[])
    return StateAnswer(step=step, state=RunState.PAUSED)
