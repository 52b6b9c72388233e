"""Who is asking, in the web app: the login of the request being served, and its role.

The web app's session (app.session.Session) refuses what the asker's role may not do, in every
handler and every gradio_client endpoint alike, so no handler has to remember to check: a viewer
sees the runs, their plots and their logs and chats with them; pressing Pause, Stop, Start,
Rewind, Teach ... answers "refused: pause needs the operator role; this login is a viewer's", the
sentence the run itself refuses a viewer's key with (contract.protocol.roles).

Gradio hands each handler its request (`request: gr.Request`, whose `username` is the login); the
session cannot take a parameter in every handler of every tab, so it reads the request Gradio has
set for the handler it is running, from `gradio.context.LocalContext.request` (a context variable
Gradio sets around every handler call and generator step, and reads itself in its ChatInterface
and caching). tests/test_roles_web.py asserts it through a real server and gradio_client, so a
Gradio that stops setting it fails there, not silently.
"""

from __future__ import annotations

from gradio.context import LocalContext

from app.users import Users
from app.web.backend import Backend
from contract.protocol.roles import Role


def asker() -> str | None:
    """The login of the request being served (None outside a request, or without logins)."""
    request = LocalContext.request.get(None)
    return getattr(request, "username", None)


def use_logins(backend: Backend, users: Users) -> None:
    """Give `backend`'s session the role of whoever asks, when the app has logins (without any,
    everyone who reaches the page is an operator, as on a private loopback app). A request with
    no login, or a login removed since, is a viewer's."""
    if not users:
        return
    backend.session.holder = "login"
    backend.session.role_of = lambda: users.role(asker()) or Role.VIEWER
