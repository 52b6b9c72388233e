"""Runs as supervised process groups: start, list, reattach, stop, and watch for dead or hung
ranks. See `supervisor.manager` for the overview. Torch-free."""

from supervisor.handle import RunHandle
from supervisor.manager import RunError, RunManager
from supervisor.records import Failure, RunInfo
from contract.protocol import STATES

__all__ = ["RunManager", "RunHandle", "RunInfo", "Failure", "RunError", "STATES"]
