"""The client's verbs (supervisor.client.Verbs) for one run of a front end's session: the web
app's API and the notebook's `Run` call these, the Python client the same methods over its own
connection, so a command's defaults, rules and words are the contract's everywhere. Each command
goes through `app.session.Session.send` (the asker's role checked, the run resolved, every
failure a SessionError with a sentence a user can act on); a bad argument is refused as a
SessionError with the command model's words before anything is sent. Torch-free."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.session import COMMAND_TIMEOUT_S, Session, SessionError
from contract.protocol.base import Command
from supervisor.client import Generation, Verbs


class SessionVerbs(Verbs):
    """The verbs of the run `ref` names (a run folder, a run name, or None / "" for the session's
    current run), sent through `session`; `connect_timeout`: how long a command waits for a
    starting run's server."""

    Refused = SessionError

    def __init__(self, session: Session, ref: str | Path | None, connect_timeout: float = 10.0):
        self.session, self.ref, self.connect_timeout = session, ref, connect_timeout

    def send(self, command: Command, timeout: float | None = None) -> Any:
        """The run's answer to `command` at its next step boundary (status at once)."""
        return self.session.send(self.ref, command, timeout=COMMAND_TIMEOUT_S if timeout is None else timeout,
                                 connect_timeout=self.connect_timeout)

    def stream(self, command: Command, timeout: float | None = None) -> Generation[Any]:
        """The run's streamed answer to `command` (generate): iterate for the pieces."""
        return self.session.stream(self.ref, command, connect_timeout=self.connect_timeout, timeout=timeout)
