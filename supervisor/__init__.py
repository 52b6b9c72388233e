"""Runs as supervised process groups: start, list, reattach, wait on, stop, and watch for dead
or hung ranks. One supervisor for every front end (terminal, web app, notebook, scripts); see
`supervisor.manager` for the overview. Torch-free; imports only `contract`. Run states are the
contract's (`contract.protocol.states.RunState`)."""

from supervisor.handle import RunHandle
from supervisor.judgement import Verdict, VerdictKind, judge
from supervisor.manager import RunError, RunManager, RunRefused
from supervisor.records import Failure, RunInfo

__all__ = ["RunManager", "RunHandle", "RunInfo", "Failure", "RunError", "RunRefused", "Verdict", "VerdictKind", "judge"]
