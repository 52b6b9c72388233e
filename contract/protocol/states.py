"""A run's states: the one definition every part of the app, the supervisor and the engine uses."""

from __future__ import annotations

from enum import Enum


class RunState(str, Enum):
    """A run's state, as written in `state` events; the one definition every part uses."""
    QUEUED = "queued"        # submitted to a scheduler (Slurm), waiting for its resources
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"

    def __str__(self) -> str:  # its value in messages and f-strings, as on the wire
        return self.value

    @property
    def final(self) -> bool:
        """The run is over; nothing can be asked of it any more."""
        return self in (RunState.FINISHED, RunState.FAILED)

    @property
    def live(self) -> bool:
        return not self.final


STATES = tuple(s.value for s in RunState)
