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

What a viewer sees: the page's top right says "signed in as bob (viewer)" with a log-out link
(Gradio's own /logout route), and every operator-only control (each carries the OPERATOR class)
is disabled, with a tooltip saying why. Gradio 6 has no tooltip argument, so the reason is the
control's `title` attribute, set in the page by TOOLTIP_HEAD from the signed-in line's
`data-why` (for an operator, a disabled control's tooltip says what it waits for instead); the disabling itself is the server's (`interactive=False` on the page's load, and
every handler that enables such a control asks `may_change` first), and the session refuses a
viewer's click anyway.
"""

from __future__ import annotations

import html

import gradio as gr
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
    roles = [role for role, _ in users.logins.values()]
    counts = ", ".join(f"{roles.count(r)} {r.value}{'s' * (roles.count(r) != 1)}" for r in Role if r in roles)
    print(f"livetune: logins are on ({counts}): the page asks for a name and password; "
          "a viewer may watch and chat, not change a run", flush=True)
    backend.session.holder = "login"
    backend.session.role_of = lambda: users.role(asker()) or Role.VIEWER


OPERATOR = "lt-op"  # elem_classes of every control only an operator may use (Start, Pause, Teach, ...)
# Why a disabled operator-only control is disabled, as its tooltip: a viewer's role (the signed-in
# line's data-why), else what it waits for: a valid config (Start), two different answers (the A/B
# choices), a training checkpoint picked, or another run state (the status line's chip). Marked
# controls carry data-lt-why, so a control enabled again loses the tooltip we gave it.
TOOLTIP_HEAD = """<script>(() => {
  const WAITS = [[/(^|-)start$|slurm-submit$/, () => 'Fix the problems the Configure tab lists first'],
                 [/prefer-[ab]-better$/, () => 'Ask for two different answers first (Two answers)'],
                 [/^ckpt-resume$/, () => 'Pick a training checkpoint first (the final model has no trainer state)']];
  const state = () => { const s = document.getElementById('run-state'); return s ? s.innerText.trim() : ''; };
  const why = (id) => {
    const viewer = document.querySelector('#signed-in [data-role=viewer]');
    if (viewer) return viewer.dataset.why;
    const found = WAITS.find(([re]) => re.test(id || ''));
    if (found) return found[1]();
    return state() ? `Not now: the run is ${state()}` : 'No run yet: start one, or open one in the Runs tab';
  };
  const mark = () => document.querySelectorAll('.%s').forEach(e => {
    const c = e.matches('button, input, textarea, select') ? e : e.querySelector('button, input, textarea, select');
    if (!c) return;
    const text = c.disabled ? why(e.id) : '';
    for (const t of [e, c]) {
      if (text && t.title !== text) { t.title = text; t.dataset.ltWhy = '1'; }
      else if (!text && t.dataset.ltWhy) { t.removeAttribute('title'); delete t.dataset.ltWhy; }
    }
  });
  new MutationObserver(mark).observe(document.documentElement, {subtree: true, childList: true, attributes: true,
                                                                attributeFilter: ['disabled']});
})();</script>""" % OPERATOR


def logins_on(backend: Backend) -> bool:
    """Whether the app asks for a login (use_logins found some)."""
    return backend.session.holder == "login"


def may_change(backend: Backend) -> bool:
    """Whether whoever asks may use the operator-only controls (always, without logins)."""
    return backend.session.role_of().may(Role.OPERATOR)


def why_disabled(name: str | None) -> str:
    """A viewer's tooltip on every operator-only control."""
    return (f"Needs the operator role: you are signed in as {name or 'nobody'}, a viewer "
            "(you may watch the runs and chat with them)")


def signed_in_html(backend: Backend) -> str:
    """The line `signed in as bob (viewer) · Log out`; empty when the app has no logins."""
    if not logins_on(backend):
        return ""
    name, role = asker(), backend.session.role_of()
    return (f"<div class='lt-signed' data-role='{role.value}' data-why='{html.escape(why_disabled(name))}'>"
            f"signed in as <b>{html.escape(name or '?')}</b> ({role.value}) · "
            "<a href='/logout' id='log-out'>Log out</a></div>")


def wire(page: gr.Blocks, backend: Backend, signed_in: gr.HTML) -> None:
    """On each page load (with logins): the signed-in line, and for a viewer every operator-only
    control of `page` (the OPERATOR class) disabled. Call after the page is built."""
    if not logins_on(backend):
        return
    controls = [b for b in page.blocks.values() if OPERATOR in (getattr(b, "elem_classes", None) or [])]

    def look() -> dict:
        off = {} if may_change(backend) else {c: gr.update(interactive=False) for c in controls}
        return {signed_in: signed_in_html(backend), **off}

    page.load(look, outputs=[signed_in, *controls], queue=False, api_visibility="private", show_progress="hidden")
