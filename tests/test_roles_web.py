"""The web app's logins and roles: passwords never on the command line, stored scrypt-hashed in a
0600 file; a viewer's login is refused every control that changes a run, in the page's handlers
and the gradio_client endpoints alike, with the sentence the run refuses a viewer's key with.
The end-to-end test serves the real app (`python -m app`) and logs in with gradio_client."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from app.__main__ import NO_ARGV_PASSWORD, parse_args
from app.session import SessionError
from app.users import Users, UsersError, hash_password, logins, read_users, verify_password, write_users
from contract.protocol.commands import Status
from contract.protocol.roles import Role, refusal
from web_page import SLOW, browser, open_tab, screenshot, served_app, wait_until  # noqa: F401 - browser: the fixture

REPO = Path(__file__).resolve().parents[1]
VIEWER_REFUSAL = "needs the operator role; this login is a viewer's"


def test_a_password_on_the_command_line_is_refused_saying_how(capsys):
    for argv in (["--password", "secret"], ["--username", "me", "--password", "secret"], ["--username", "me"]):
        with pytest.raises(SystemExit) as done:
            parse_args(argv)
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert "LIVETUNE_PASSWORD" in err and "python -m app.users add" in err and "secret" not in err
    assert "(ps)" in NO_ARGV_PASSWORD


def test_passwords_are_stored_hashed_and_checked(tmp_path):
    stored = hash_password("s3cret")
    assert "s3cret" not in stored and stored.startswith("scrypt$") and stored != hash_password("s3cret")
    assert verify_password("s3cret", stored) and not verify_password("s3cret ", stored)
    assert not verify_password("x", "md5$abc")
    users = Users()
    users.add("op", Role.OPERATOR, "a")
    users.add("v", Role.VIEWER, "b")
    path = tmp_path / "users"
    write_users(path, users)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    back = read_users(path)
    assert back.check("op", "a") and back.check("v", "b")
    assert not back.check("v", "a") and not back.check("nobody", "b")  # a wrong password: no login
    assert back.role("v") is Role.VIEWER and back.role("op") is Role.OPERATOR and back.role("x") is None
    os.chmod(path, 0o644)
    with pytest.raises(UsersError, match="chmod 600"):
        read_users(path)


def test_the_users_command_reads_the_password_from_stdin_and_the_env_login_is_hashed(tmp_path):
    path = tmp_path / "users"
    done = subprocess.run([sys.executable, "-m", "app.users", "--file", str(path), "add", "ann", "--role", "viewer"],
                          input="pw-of-ann\n", capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pw-of-ann" not in path.read_text() and read_users(path).check("ann", "pw-of-ann")
    assert read_users(path).role("ann") is Role.VIEWER
    environ = {"LIVETUNE_USERNAME": "boss", "LIVETUNE_PASSWORD": "pw-of-boss"}
    users = logins(tmp_path, path, environ)
    assert "LIVETUNE_PASSWORD" not in environ  # the runs the app starts never inherit it
    assert users.check("boss", "pw-of-boss") and users.role("boss") is Role.OPERATOR and users.role("ann")


# -- handler level: the request Gradio is serving carries the login ---------------------------------
@pytest.fixture
def backend(tmp_path):
    from app.web.access import use_logins
    from app.web.backend import Backend
    users = Users()
    users.add("op", Role.OPERATOR, "a")
    users.add("v", Role.VIEWER, "b")
    b = Backend(tmp_path / "runs")
    use_logins(b, users)
    yield b
    b.close()


def _as(username: str | None):
    import gradio as gr
    from gradio.context import LocalContext
    return LocalContext.request.set(gr.Request(username=username) if username else None)


def test_a_viewers_login_is_refused_the_pages_controls(backend):
    from gradio.context import LocalContext

    from app.web.train import _act
    for username, role in (("v", Role.VIEWER), (None, Role.VIEWER), ("op", Role.OPERATOR)):
        token = _as(username)
        try:
            for what in ("pause", "stop", "set_lr"):
                with pytest.raises(SessionError) as refused:
                    _act(backend, what, None, new_lr=0.1)
                if role is Role.VIEWER:
                    action = {"set_lr": "set"}.get(what, what)
                    assert str(refused.value) == refusal(action, Role.VIEWER, "login")
                else:  # an operator passes the check: refused only because there is no run
                    assert "no run yet" in str(refused.value)
            with pytest.raises(SessionError) as chat:  # a viewer may chat: refused for want of a run
                list(backend.session.chat(None, [{"role": "user", "content": "hi"}]))
            assert "no run yet" in str(chat.value)
            with pytest.raises(SessionError, match="no run yet"):
                backend.session.send(None, Status())
        finally:
            LocalContext.request.reset(token)


# -- end to end: the real app, logged in with gradio_client ----------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The real app (`python -m app`) with logins: viewers `viewer` and `bob` in its users file, the
    operator `boss` from the environment; yields (url, its folder, its process id)."""
    root = tmp_path_factory.mktemp("roles")
    users = Users()
    users.add("viewer", Role.VIEWER, "pw-viewer")
    users.add("bob", Role.VIEWER, "pw-bob")
    write_users(root / "runs" / ".users", users)
    with served_app(root, {"LIVETUNE_USERNAME": "boss", "LIVETUNE_PASSWORD": "pw-boss"}) as (url, _runs, pid):
        yield url, root, pid


@pytest.mark.slow
def test_the_served_app_logs_in_by_role_and_refuses_a_viewer_the_endpoints_that_change_a_run(served):
    from gradio_client import Client
    url, _, pid = served
    assert "pw-boss" not in " ".join(Path(f"/proc/{pid}/cmdline").read_text().split("\0"))
    with pytest.raises(Exception):  # a wrong password: no login (gradio_client's own error)
        Client(url, auth=("viewer", "wrong"), verbose=False)
    viewer = Client(url, auth=("viewer", "pw-viewer"), verbose=False)
    assert viewer.predict(api_name="/runs") == []
    for api_name, args in (("/pause", {}), ("/set", {"lr": 0.1}), ("/start", {"config": ""}),
                           ("/rewind", {"target": "step-1"}), ("/teach", {"prompt": "a", "answer": "b"})):
        with pytest.raises(Exception) as refused:
            viewer.predict(api_name=api_name, **args)
        assert VIEWER_REFUSAL in str(refused.value), (api_name, refused.value)
    with pytest.raises(Exception) as no_run:  # a viewer may ask the status: refused for want of a run
        viewer.predict(api_name="/status")
    assert "no run" in str(no_run.value)
    boss = Client(url, auth=("boss", "pw-boss"), verbose=False)
    with pytest.raises(Exception) as no_run:  # the operator passes the check; there is no run to pause
        boss.predict(api_name="/pause")
    assert "no run yet" in str(no_run.value)


def test_a_viewers_train_tab_shows_its_controls_disabled(backend):
    import gradio as gr
    from gradio.context import LocalContext

    from app.session import allowed
    from app.web import train
    assert allowed("running", Role.VIEWER) == {"generate", "complete", "status", "branches", "inbox"}
    with gr.Blocks():
        view = train.TrainView(gr.State(None), gr.State(None), gr.Checkbox(), gr.HTML(), gr.HTML(), gr.Code(),
                               gr.Textbox(), {name: gr.Button() for name in train.COMMAND_OF}, gr.Button(),
                               role_of=backend.session.role_of)
    operator = {"pause", "stop", "stop_other", "save", "evaluate", "set_lr", "set_settings"}
    for username, enabled in (("v", set()), ("op", operator)):
        token = _as(username)
        try:
            controls = view.controls("running")
        finally:
            LocalContext.request.reset(token)
        assert {n for n, b in view.buttons.items() if controls[b]["interactive"]} == enabled


# -- in the browser: who is signed in, and a viewer's page -----------------------------------------
# every operator-only control a viewer's page shows disabled, each with the tooltip saying why
# per tab: the closed folds to open, then the controls
OPERATOR_ONLY = {"Configure": ((), ("cfg-start",)),
                 "Train": (("train-settings", "data-fold", "side-prefer-fold"),
                           ("train-start", "train-pause", "train-set-lr", "train-settings-apply", "data-remove",
                            "side-prefer-a-better")),
                 "Chat": (("chat-teach-fold", "chat-prefer-fold"),
                          ("chat-teach", "chat-prefer-a-better", "chat-prefer-b-better", "chat-prefer-edit-send")),
                 "Checkpoints": ((), ("ckpt-export", "ckpt-resume", "branch-rewind"))}


def _sign_in(page, url: str, name: str, password: str) -> None:
    page.goto(url)
    page.locator("input[type=text], input:not([type])").first.fill(name)
    page.locator("input[type=password]").first.fill(password)
    page.get_by_role("button", name="Login").click()
    page.locator("#signed-in [data-role]").wait_for(timeout=SLOW)


def _control(page, elem_id: str):
    found = page.locator(f"#{elem_id}")
    return found if found.evaluate("e => e.tagName") == "BUTTON" else found.locator("button").first


@pytest.mark.slow
def test_a_viewer_sees_who_is_signed_in_and_every_operator_control_disabled_with_why(served, browser):
    url, root, _ = served
    log = (root / "app.log").read_text()
    assert "logins are on (2 viewers, 1 operator)" in log, log
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(url)
        screenshot(page, "login")
        _sign_in(page, url, "bob", "pw-bob")
        assert page.locator("#signed-in").inner_text().startswith("signed in as bob (viewer)")
        assert page.locator("#log-out").get_attribute("href") == "/logout"
        for tab, (folds, elem_ids) in OPERATOR_ONLY.items():
            open_tab(page, tab)
            for fold in folds:
                page.locator(f"#{fold}").click()
            if tab == "Configure":
                screenshot(page, "viewer")
            for elem_id in elem_ids:
                page.locator(f"#{elem_id}").wait_for(state="attached", timeout=30_000)
                control = _control(page, elem_id)
                wait_until(lambda: control.is_disabled(), 30, f"{elem_id} disabled for a viewer")
                wait_until(lambda: "Needs the operator role: you are signed in as bob, a viewer" in (
                    control.get_attribute("title") or ""), 10, f"{elem_id}'s tooltip")
        open_tab(page, "Chat")
        assert _control(page, "chat-send").is_enabled()  # a viewer may chat
        page.locator("#log-out").click()
        page.locator("input[type=password]").wait_for(timeout=60_000)  # back at the login form
        _sign_in(page, url, "boss", "pw-boss")
        assert page.locator("#signed-in").inner_text().startswith("signed in as boss (operator)")
        wait_until(lambda: _control(page, "cfg-start").is_enabled(), 60, "Start enabled for the operator")
        screenshot(page, "configure")
        assert not _control(page, "cfg-start").get_attribute("title")
        # an operator's disabled controls say what they wait for
        open_tab(page, "Train")
        wait_until(lambda: "No run yet" in (_control(page, "train-pause").get_attribute("title") or ""), 30,
                   "Pause's tooltip: no run yet")
        open_tab(page, "Chat")
        page.locator("#chat-prefer-fold").click()
        page.locator("#chat-prefer-a-better").wait_for(state="attached", timeout=30_000)
        wait_until(lambda: "two different answers" in (_control(page, "chat-prefer-a-better").get_attribute("title")
                                                       or ""), 30, "the A/B choice's tooltip")
    finally:
        page.close()
