"""Who may do what: the two roles of a key or login, declared once for every front end.

A **viewer** may list and watch runs, chat with them, preview, read their status and events and
call the OpenAI-compatible API. An **operator** may also change a run: stop, pause, resume, set,
save, evaluate, rewind, branch, snapshot, teach, prefer, forget, the data commands, and start,
resume or export runs. Each command class says which role it needs (`Command.role`, operator
unless the class says viewer); the control server, the web app, its gradio_client endpoints and
the OpenAI API all check that one declaration, and refuse with the same sentence (`refusal`).
"""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """What a key or login may do; an operator may do everything a viewer may."""
    VIEWER = "viewer"
    OPERATOR = "operator"

    def __str__(self) -> str:  # its value in messages, as in files
        return self.value

    def may(self, needed: "Role") -> bool:
        """Whether this role may do what `needed` is required for."""
        return self is Role.OPERATOR or needed is Role.VIEWER


ROLES = tuple(r.value for r in Role)


def refusal(action: str, role: Role, holder: str = "key") -> str:
    """The one sentence every front end refuses `action` with when `role` may not do it
    (`holder`: "key", or "login" in the web app)."""
    return f"refused: {action} needs the operator role; this {holder} is a {role.value}'s"


def check_role(action: str, needed: Role, role: Role, holder: str = "key") -> None:
    """Raise PermissionError (with `refusal`'s sentence) when `role` may not do `action`."""
    if not role.may(needed):
        raise PermissionError(refusal(action, role, holder))
