"""The control server and the client over real loopback sockets, without an engine.

The test itself plays the training thread: it drains the command queue and answers, the way
the step boundary does on rank 0. (End to end with the engine: test_control_live.py.)
"""

import json
import os
import socket
import stat
import threading
import time

import pytest

from supervisor.client import CommandError, RunClient, RunGone
from engine.control.pending import CommandQueue
from engine.control.server import ControlServer
from contract.protocol.wire import MAX_MESSAGE_BYTES
from contract.run_folder import EventLog, RunFolder
import fake_answers


class Served:
    """A server on a fresh run folder, and a thread answering its queued commands in order."""

    def __init__(self, root):
        self.folder = RunFolder(root).create()
        self.events = EventLog(self.folder.events)
        self.queue = CommandQueue()
        self.executed: list[tuple[str, str, dict]] = []
        self.server = ControlServer(self.folder, self.queue, fake_answers.status)
        self.events.subscribe(self.server.notify)
        self.server.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._boundaries, daemon=True)
        self._thread.start()

    def _boundaries(self):
        while not self._stop.is_set():
            self.queue.wait(0.05)
            for item in self.queue.drain():
                self.executed.append((item.id, item.cmd, item.args))
                if item.cmd == "generate":
                    for piece in ("he", "llo"):
                        item.reply.token(piece)
                item.reply.done(fake_answers.answer(item))

    def raw(self):
        info = json.loads(self.folder.control.read_text())
        sock = socket.create_connection((info["host"], info["port"]))
        return sock, sock.makefile("rb"), info["token"]

    def close(self):
        self._stop.set()
        self._thread.join()
        self.server.close()
        self.events.close()


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path / "run")
    yield s
    s.close()


def _ask(sock, reader, message: bytes) -> dict:
    sock.sendall(message)
    return json.loads(reader.readline())


def test_control_file_is_private_and_names_a_live_address(served):
    mode = stat.S_IMODE(os.stat(served.folder.control).st_mode)
    assert mode == 0o600
    info = json.loads(served.folder.control.read_text())
    assert set(info) == {"host", "port", "token", "pid"} and info["pid"] == os.getpid()
    assert info["host"] == "127.0.0.1" and len(info["token"]) >= 32


def test_bad_messages_are_refused_and_change_nothing(served):
    sock, reader, token = served.raw()
    good = {"token": token, "id": "x", "cmd": "pause", "args": {}}
    cases = {
        b"{not json\n": "malformed JSON",
        b"[1, 2]\n": "token",
        json.dumps({**good, "token": "wrong"}).encode() + b"\n": "token",
        json.dumps({k: v for k, v in good.items() if k != "token"}).encode() + b"\n": "token",
        json.dumps({**good, "cmd": "rm -rf"}).encode() + b"\n": "unknown command",
        json.dumps({**good, "cmd": "stop", "args": {"save": "yes"}}).encode() + b"\n": "must be true or false",
        json.dumps({**good, "cmd": "set", "args": {"lr": -1}}).encode() + b"\n": "must be",
        json.dumps({**good, "cmd": "set", "args": {"momentum": 1}}).encode() + b"\n": "unknown argument",
        json.dumps({**good, "cmd": "generate", "args": {}}).encode() + b"\n": "exactly one",
        json.dumps({**good, "cmd": "generate", "args": {"messages": [{"role": "x"}]}}).encode() + b"\n": "messages[0]",
        json.dumps({**good, "cmd": "generate", "args": {"prompt": "a", "top_p": 0}}).encode() + b"\n": "top_p",
        b"x" * (MAX_MESSAGE_BYTES + 10) + b"\n": "larger than",
    }
    for message, expected in cases.items():
        answer = _ask(sock, reader, message)
        assert answer["type"] == "error" and expected in answer["message"], (message[:80], answer)
    # the connection still works and nothing was queued or executed by any refused message
    answer = _ask(sock, reader, json.dumps({**good, "cmd": "status"}).encode() + b"\n")
    assert answer["type"] == "done" and answer["id"] == "x"
    assert {k: answer["result"][k] for k in ("step", "state")} == {"step": 7, "state": "running"}
    assert answer["result"]["control"]["connections"] == 1
    time.sleep(0.2)
    assert served.executed == []
    sock.close()


def test_commands_of_several_clients_run_in_order_and_answer_their_sender(served):
    clients = [RunClient.connect(served.folder.root, timeout=5) for _ in range(3)]
    results: dict[int, list] = {i: [] for i in range(3)}

    def drive(i):
        for k in range(5):
            results[i].append(clients[i].set(eval_every_n_steps=10 * i + k))

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):  # each client got the answers to its own commands, in its order
        assert [r.changes["eval_every_n_steps"] for r in results[i]] == [10 * i + k for k in range(5)]
    assert len(served.executed) == 15
    streamed = clients[0].generate("hi", max_new_tokens=3)
    assert list(streamed) == ["he", "llo"] and streamed.result.text == "hello"
    assert all(c.model == "current" for c in clients[1].generate("x"))
    for c in clients:
        c.close()


def test_events_from_a_line_then_live_with_reconnects_lose_nothing(served):
    for i in range(5):
        served.events.emit({"type": "train", "step": i})
    client = RunClient.connect(served.folder.root, timeout=5)
    seen = []
    stream = client.events(from_line=2)

    def writer():
        for i in range(5, 40):
            served.events.emit({"type": "train", "step": i})
            if i % 10 == 0:  # the server drops every connection: the client must reconnect
                served.server.disconnect_all()
            time.sleep(0.01)

    t = threading.Thread(target=writer)
    t.start()
    for event in stream:
        seen.append(event)
        if event["step"] == 39:
            break
    t.join()
    assert [e["step"] for e in seen] == list(range(2, 40))
    assert [e["line"] for e in seen] == list(range(2, 40))
    client.close()


def test_after_close_events_come_from_the_file_and_commands_fail_clearly(tmp_path):
    s = Served(tmp_path / "run")
    client = RunClient.connect(s.folder.root, timeout=5)
    s.events.emit({"type": "state", "state": "running"})
    s.events.emit({"type": "state", "state": "finished"})
    s.close()
    assert not s.folder.control.exists()
    assert [e["state"] for e in client.events()] == ["running", "finished"]
    with pytest.raises(RunGone):
        client.pause()


def test_a_closed_queue_refuses_with_its_reason(served):
    client = RunClient.connect(served.folder.root, timeout=5)
    served.queue.close("training has ended")
    with pytest.raises(CommandError, match="training has ended"):
        client.pause()
    assert client.status().step == 7  # status is answered at once, still
    client.close()
