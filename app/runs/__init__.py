"""Runs as supervised process groups: start, list, reattach, stop, and watch for dead or hung
ranks. See `app.runs.manager` for the overview. Torch-free."""

from app.runs.handle import RunHandle
from app.runs.manager import RunError, RunManager
from app.runs.records import Failure, RunInfo
from engine.protocol import STATES

__all__ = ["RunManager", "RunHandle", "RunInfo", "Failure", "RunError", "STATES"]
