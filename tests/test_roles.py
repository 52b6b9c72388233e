"""Who may do what (contract.protocol.roles): a viewer's key is refused every command that changes
the run, with the same sentence, on the control socket and through RunClient; its reads and
chats are answered. Real loopback sockets, the test playing the step boundary (test_control_server's
Served); the web app's and the OpenAI API's refusals are in test_roles_web.py."""

import json
import os
import socket
import stat

import pytest

from contract.protocol.branch_commands import Branches
from contract.protocol.commands import COMMANDS, REQUESTS, Generate, Pause, Set, Status
from contract.protocol.data_commands import Inbox
from contract.protocol.roles import Role, refusal
from contract.protocol.states import RunState
from supervisor.client import CommandError, RunClient
from test_control_server import Served

VIEWER_COMMANDS = {"generate", "complete", "status", "subscribe", "branches", "inbox"}


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path / "run")
    yield s
    s.close()


def test_the_rule_is_declared_once_on_the_command_classes():
    assert {name for name, c in REQUESTS.items() if c.role is Role.VIEWER} == VIEWER_COMMANDS
    assert all(c.role is Role.OPERATOR for name, c in COMMANDS.items() if name not in VIEWER_COMMANDS)
    assert Role.OPERATOR.may(Role.OPERATOR) and Role.OPERATOR.may(Role.VIEWER)
    assert Role.VIEWER.may(Role.VIEWER) and not Role.VIEWER.may(Role.OPERATOR)
    assert refusal("pause", Role.VIEWER) == "refused: pause needs the operator role; this key is a viewer's"


def test_viewer_file_is_private_and_holds_only_the_viewer_token(served):
    viewer = json.loads(served.folder.viewer.read_text())
    operator = json.loads(served.folder.control.read_text())
    assert stat.S_IMODE(os.stat(served.folder.viewer).st_mode) == 0o600
    assert viewer["role"] == "viewer" and viewer["token"] != operator["token"]
    assert {k: viewer[k] for k in ("host", "port", "pid")} == {k: operator[k] for k in ("host", "port", "pid")}
    assert operator["token"] not in served.folder.viewer.read_text()


def test_a_viewer_token_is_refused_every_operator_command_before_it_is_queued(served):
    info = json.loads(served.folder.viewer.read_text())
    sock = socket.create_connection((info["host"], info["port"]))
    reader = sock.makefile("rb")
    refused = {"pause": {}, "resume": {}, "stop": {}, "save": {}, "evaluate": {}, "set": {"lr": 0.1},
               "rewind": {"target": "step-1"}, "branch": {"target": "step-1", "branch": "b"},
               "snapshot": {}, "teach": {"prompt": "a", "answer": "b"}, "forget": {"id": "t1"},
               "add_source": {"path": "x.jsonl"}, "set_weight": {"source": "s", "weight": 1.0},
               "remove_source": {"source": "s"}, "add_reward": {"reward": {"kind": "regex", "pattern": "a"}},
               "remove_reward": {"reward": "r"}, "rate": {"step": 1, "sample": 0, "score": 1.0},
               "rate_chat": {"prompt": "a", "answer": "b", "score": 1.0}}
    assert set(refused) == set(COMMANDS) - VIEWER_COMMANDS  # every operator command is tried
    for i, (cmd, args) in enumerate(refused.items()):
        sock.sendall(json.dumps({"token": info["token"], "id": i, "cmd": cmd, "args": args}).encode() + b"\n")
        answer = json.loads(reader.readline())
        assert answer == {"type": "error", "id": str(i), "message": refusal(cmd, Role.VIEWER)}
    sock.sendall(json.dumps({"token": info["token"], "id": "s", "cmd": "status", "args": {}}).encode() + b"\n")
    assert json.loads(reader.readline())["result"]["step"] == 7
    sock.close()
    assert served.executed == []  # nothing refused reached the boundary


def test_run_client_as_viewer_reads_and_chats_and_is_refused_changes(served):
    with RunClient.connect(served.folder.root, timeout=5, role=Role.VIEWER) as viewer:
        assert viewer.key_role() is Role.VIEWER
        assert viewer.status().step == 7
        assert "".join(viewer.generate("hi")) == "hello"
        assert viewer.send(Branches()).current == "main" and viewer.send(Inbox()).entries == []
        for call, name in ((viewer.pause, "pause"), (lambda: viewer.set(lr=0.1), "set"),
                           (lambda: viewer.teach("a", "b"), "teach"), (viewer.stop, "stop")):
            with pytest.raises(CommandError) as refused:
                call()
            assert str(refused.value) == refusal(name, Role.VIEWER)
        served.events.emit({"type": "train", "step": 3})
        stream = viewer.events(from_line=0)  # subscribing is a viewer's right
        assert next(stream)["step"] == 3
        stream.close()
    with RunClient.connect(served.folder.root, timeout=5) as operator:  # control.json is readable here
        assert operator.key_role() is Role.OPERATOR
        assert operator.send(Pause()).state == RunState.PAUSED
    assert [cmd for _, cmd, _ in served.executed] == ["generate", "branches", "inbox", "pause"]


def test_a_copied_viewer_file_is_a_key(served, tmp_path):
    copy = tmp_path / "handed-over.json"
    copy.write_text(served.folder.viewer.read_text())
    with RunClient.connect(served.folder.root, timeout=5, address=copy) as client:
        assert client.key_role() is Role.VIEWER
        assert client.send(Status()).step == 7
        with pytest.raises(CommandError, match="needs the operator role"):
            client.send(Set(lr=0.5))
        assert client.send(Generate(prompt="x")) is not None


# -- the OpenAI API: both keys answer, a viewer's only what a viewer may, and the API itself holds a viewer's token
def test_the_api_takes_both_keys_and_holds_only_a_viewers_rights(tmp_path):
    import httpx

    from supervisor.openai_api import KEY_FILE, VIEWER_KEY_FILE, ApiError, ApiServer, key_of

    served, server = Served(tmp_path / "run"), None
    try:
        server = ApiServer(tmp_path).start()
        runs = server.app.state.runs
        operator_key, viewer_key = runs.key(served.folder.root), key_of(served.folder.root, VIEWER_KEY_FILE)
        for file in (KEY_FILE, VIEWER_KEY_FILE):
            assert stat.S_IMODE(os.stat(served.folder.root / file).st_mode) == 0o600
        assert operator_key != viewer_key
        body = {"model": "run", "prompt": "hi", "max_tokens": 2}
        for key in (operator_key, viewer_key):
            auth = {"Authorization": f"Bearer {key}"}
            assert [m["id"] for m in httpx.get(f"{server.url}/models", headers=auth).json()["data"]] == ["run"]
            assert httpx.post(f"{server.url}/completions", headers=auth, json=body).status_code == 200
        wrong = httpx.post(f"{server.url}/completions", headers={"Authorization": "Bearer lt-x"}, json=body)
        assert wrong.status_code == 401
        assert [cmd for _, cmd, _ in served.executed] == ["complete", "complete"]
        # the rule, should an endpoint ever need an operator: a viewer's key gets 403 and the sentence
        assert runs.granted(operator_key, needs=Role.OPERATOR) == {served.folder.root}
        with pytest.raises(ApiError) as refused:
            runs.granted(viewer_key, needs=Role.OPERATOR)
        assert refused.value.status == 403 and "needs the operator role; this key is a viewer's" in refused.value.message
        # the API connects to the run with the run's viewer token: it cannot change the run
        client = runs.client(served.folder.root)
        assert client.key_role() is Role.VIEWER
        with pytest.raises(CommandError, match="refused: pause needs the operator role"):
            client.pause()
        assert [cmd for _, cmd, _ in served.executed] == ["complete", "complete"]
    finally:
        if server is not None:
            server.close()
        served.close()


def test_a_viewers_session_is_refused_with_the_same_sentence(tmp_path):
    """The notebook's and terminal's Session: Session(role=Role.VIEWER) uses the viewer's key and
    refuses, before sending, what the run would refuse that key."""
    from app.session import Session, SessionError
    session = Session(tmp_path, role=Role.VIEWER)
    try:
        for act, name in ((lambda: session.send(None, Pause()), "pause"), (lambda: session.stop(None), "stop"),
                          (lambda: session.send(None, Set(lr=0.1)), "set")):
            with pytest.raises(SessionError) as refused:
                act()
            assert str(refused.value) == refusal(name, Role.VIEWER)
        with pytest.raises(SessionError, match="no run yet"):  # a viewer may ask: refused for want of a run
            session.send(None, Status())
    finally:
        session.close()
