"""The web app's logins and roles: passwords never on the command line, stored scrypt-hashed in a
0600 file; a viewer's login is refused every control that changes a run, in the page's handlers
and the gradio_client endpoints alike, with the sentence the run refuses a viewer's key with.
The end-to-end test serves the real app (`python -m app`) and logs in with gradio_client."""

import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from app.__main__ import NO_ARGV_PASSWORD, parse_args
from app.session import SessionError
from app.users import Users, UsersError, hash_password, logins, read_users, verify_password, write_users
from contract.protocol.commands import Status
from contract.protocol.roles import Role, refusal
from dist_utils import free_port

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
@pytest.mark.slow
def test_the_served_app_logs_in_by_role_and_refuses_a_viewer_the_endpoints_that_change_a_run(tmp_path):
    from gradio_client import Client
    runs, port = tmp_path / "runs", free_port()
    users = Users()
    users.add("viewer", Role.VIEWER, "pw-viewer")
    write_users(runs / ".users", users)
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONPATH=str(REPO),
               LIVETUNE_USERNAME="boss", LIVETUNE_PASSWORD="pw-boss")
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "app", "--port", str(port), "--output-dir", str(runs)],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(url, timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("the app did not come up:\n" + (tmp_path / "app.log").read_text()[-3000:])
                time.sleep(0.5)
        assert "pw-boss" not in " ".join(Path(f"/proc/{proc.pid}/cmdline").read_text().split("\0"))
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
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


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
