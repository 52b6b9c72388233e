"""The control server's limits, over real loopback sockets against the real server (no engine:
the test plays the training thread, as in test_control_server.py). The live 2-rank checks are in
test_control_limits_live.py.

No assertion here depends on how fast the machine is: timeouts are shortened through the
server's constructor and every wait is for an outcome (an answer, an end of stream), bounded
far above what it needs.
"""

import json
import socket
import threading
import time

import psutil
import pytest

from supervisor.client import RunClient
from engine.control.limits import SEND_HIGH_WATER, PromptLimit, context_tokens
from engine.control.server import ControlServer
from engine.data.default_task import build_tokenizer, default_model_config
from engine.control import handlers
from engine.control.pending import CommandQueue
from contract.protocol.wire import MAX_MESSAGE_BYTES
from contract.run_folder import EventLog, RunFolder
import fake_answers


class Served:
    """A server with `limits`, and a thread answering queued commands (unless `answering=False`)."""

    def __init__(self, root, answering: bool = True, admit=None, **limits):
        self.folder = RunFolder(root).create()
        self.events = EventLog(self.folder.events)
        self.queue = CommandQueue()
        self.executed: list = []
        self.server = ControlServer(self.folder, self.queue, fake_answers.status, admit=admit, **limits)
        self.events.subscribe(self.server.notify)
        self.server.start()
        self.token = self.server.token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._boundaries, args=(answering,), daemon=True)
        self._thread.start()

    def _boundaries(self, answering: bool) -> None:
        while not self._stop.is_set():
            self.queue.wait(0.05)
            if answering:
                for item in self.queue.drain():
                    self.executed.append((item.cmd, item.args))
                    item.reply.done(fake_answers.answer(item))

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # set before connecting, so the window stays small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(30)
        sock.connect((self.server.host, self.server.port))
        return sock

    def line(self, cmd: str, req_id="r", **args) -> bytes:
        return json.dumps({"token": self.token, "id": req_id, "cmd": cmd, "args": args}).encode() + b"\n"

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.server.close()
        self.events.close()


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path / "run")
    yield s
    s.close()


def answers(sock: socket.socket) -> list[dict]:
    """Every message until the server ends the connection."""
    with sock.makefile("rb") as reader:
        return [json.loads(raw) for raw in reader if raw.strip()]


def ask(sock: socket.socket, message: bytes) -> dict:
    sock.sendall(message)
    return json.loads(sock.makefile("rb").readline())


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.02)


def test_a_hundred_clients_leave_no_thread_behind(served):
    me = psutil.Process()
    RunClient(served.folder.root).close()  # the client's imports done before counting
    baseline = me.num_threads()
    for _ in range(100):
        with RunClient.connect(served.folder.root, timeout=10) as client:
            assert client.status().step == 7
    wait_until(lambda: served.server.stats()["connections"] == 0)
    wait_until(lambda: me.num_threads() <= baseline)  # the clients' reader threads end too
    assert served.server.stats()["accepted"] == 100


def test_half_a_line_then_nothing_is_dropped_with_the_reason(tmp_path):
    s = Served(tmp_path / "run", read_timeout=0.5)
    try:
        sock = s.connect()
        sock.sendall(b'{"token": "' + s.token.encode())
        got = answers(sock)  # the server ends the connection by itself
        assert len(got) == 1 and "no complete message within 0.5 s" in got[0]["message"]
        # a client that keeps sending whole lines is never cut
        sock = s.connect()
        for _ in range(3):
            assert ask(sock, s.line("status"))["type"] == "done"
            time.sleep(0.3)
        sock.close()
    finally:
        s.close()


def test_an_endless_line_is_refused_then_cut(tmp_path):
    s = Served(tmp_path / "run", read_timeout=3.0)  # time enough to send 1 MiB on a loaded machine
    try:
        sock = s.connect()
        sock.sendall(b"x" * (MAX_MESSAGE_BYTES + 100))  # too long, and never ended
        got = answers(sock)
        assert "larger than" in got[0]["message"] and "no complete message within 3 s" in got[-1]["message"]
    finally:
        s.close()


def test_idle_connections_close_and_the_client_reconnects(tmp_path):
    s = Served(tmp_path / "run", idle_timeout=2.0)
    try:
        sock = s.connect()
        assert "idle for 2 s" in answers(sock)[0]["message"]
        client = RunClient(s.folder.root)
        assert client.status().step == 7  # connects and asks in one call
        wait_until(lambda: s.server.stats()["connections"] == 0)  # closed for idling
        assert client.status().step == 7  # a fresh connection, transparently
        client.close()
    finally:
        s.close()


def test_hostile_messages_all_get_an_error_answer(served):
    sock = served.connect()
    base = {"token": served.token, "id": "h", "cmd": "set"}
    cases = {
        "400-digit lr": json.dumps({**base, "args": {"lr": 10**400}}).encode(),
        "5000-digit lr": b'{"token": "t", "id": 1, "cmd": "set", "args": {"lr": ' + b"9" * 5000 + b"}}",
        "nested 100000 deep": b"[" * 100_000 + b"]" * 100_000,
        "nested object in args": json.dumps(base)[:-1].encode() + b', "args": ' + b'{"a":' * 50_000 + b"1" +
        b"}" * 50_000 + b"}",
        "NaN lr": json.dumps({**base, "args": {"lr": float("nan")}}).encode(),
        "huge max_new_tokens": json.dumps({**base, "cmd": "generate", "args": {"prompt": "a",
                                                                               "max_new_tokens": 10**30}}).encode(),
        "long id": json.dumps({**base, "id": "i" * 10_000, "cmd": "status"}).encode(),
        "invalid UTF-8": b'{"token": "\xff\xfe", "id": 1}',
        "a lone number": b"12",
    }
    for name, message in cases.items():
        answer = ask(sock, message + b"\n")
        assert answer["type"] == "error" and answer["message"], (name, answer)
    assert ask(sock, served.line("status"))["type"] == "done"  # the same connection goes on
    assert served.executed == []
    sock.close()


def test_a_burst_of_200_connections_is_served_or_refused_cleanly(tmp_path):
    s = Served(tmp_path / "run", max_connections=64)
    try:
        outcomes: list = [None] * 200
        connected = threading.Semaphore(0)
        ask, leave = threading.Event(), threading.Event()

        def one(i: int) -> None:
            try:
                sock = s.connect()
            except OSError as e:  # recorded, asserted below
                outcomes[i] = e
                return
            finally:
                connected.release()
            ask.wait(120)  # every connection is open before any asks
            try:
                sock.sendall(s.line("status", req_id=i))
            except OSError:  # a refused connection may be reset already; its refusal is still readable
                pass
            try:
                outcomes[i] = json.loads(sock.makefile("rb").readline())
            except (OSError, ValueError) as e:
                outcomes[i] = e
            leave.wait(120)  # the served ones stay open until every client has its answer
            sock.close()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(200)]
        for t in threads:
            t.start()
        for _ in threads:
            assert connected.acquire(timeout=120)
        ask.set()
        wait_until(lambda: all(o is not None for o in outcomes), timeout=120)
        leave.set()
        for t in threads:
            t.join(60)
        served_ok = [o for o in outcomes if isinstance(o, dict) and o["type"] == "done"]
        refused = [o for o in outcomes if isinstance(o, dict) and o["type"] == "error"
                   and "64 connections" in o["message"]]
        assert len(served_ok) + len(refused) == 200, [o for o in outcomes if o not in served_ok + refused][:3]
        assert len(served_ok) == 64
        assert s.server.stats()["refused"] == 136
    finally:
        leave.set()
        s.close()


def test_subscribers_that_never_read_cost_a_bounded_buffer_are_dropped_and_do_not_hold_close(tmp_path):
    s = Served(tmp_path / "run", stall_timeout=1.0, drop_grace=30.0)
    stuck = []
    for i in range(4):
        sock = s.connect(rcvbuf=4096)
        sock.sendall(s.line("subscribe", req_id=f"viewer-{i}", from_line=0))
        stuck.append(sock)
    wait_until(lambda: s.server.stats()["connections"] == 4)
    blob = "x" * 2000
    for step in range(3000):  # ~6 MB of events: far more than the kernel buffers hold
        s.events.emit({"type": "train", "step": step, "blob": blob})
    # while the viewers are stuck, rank 0 keeps at most about the high-water mark for each
    buffered = [c.transport.get_write_buffer_size() for c in list(s.server.clients)]
    assert all(size <= SEND_HIGH_WATER + 128 * 1024 for size in buffered), buffered
    wait_until(lambda: len(s.server.stats()["dropped"]) == 4)  # dropped after the stall
    drops = s.server.stats()["dropped"]
    assert sorted(d["ids"][-1] for d in drops) == [f"viewer-{i}" for i in range(4)]
    assert all("took nothing for 1 s" in d["reason"] and "resubscribe from line" in d["reason"] for d in drops)
    # a dropped viewer that starts reading within the grace period gets what was buffered for it,
    # then the reason as its last line, and the connection ends
    for sock in stuck:
        got = answers(sock)
        assert got[0]["type"] == "ack" and [m["line"] for m in got[1:-1]] == list(range(len(got) - 2))
        assert got[-1]["type"] == "error" and "dropped by the run" in got[-1]["message"]
    wait_until(lambda: s.server.stats()["connections"] == 0)
    # a new client learns of the drops from status, and stop does not wait on stuck viewers
    # (48 of them: the old server spent about 5 s on each at the end of a run)
    more = []
    for i in range(48):
        sock = s.connect(rcvbuf=4096)
        sock.sendall(s.line("subscribe", req_id=f"late-{i}", from_line=0))
        more.append(sock)
    client = RunClient.connect(s.folder.root, timeout=10)
    assert len(client.status().control["dropped"]) == 4
    wait_until(lambda: s.server.stats()["connections"] == 49)
    started = time.monotonic()
    s.close()
    # CLOSE_GRACE_S (1 s) and no wait per viewer: the old server spent about 5 s on each (4 minutes
    # for these 48); the bound is far from both, so a loaded machine cannot break it
    assert time.monotonic() - started < 60.0
    for sock in stuck + more:
        sock.close()


def test_commands_past_the_pending_cap_are_refused_at_once(tmp_path):
    s = Served(tmp_path / "run", answering=False, max_pending=3)
    try:
        sock = s.connect()
        for i in range(3):
            assert ask(sock, s.line("pause", req_id=i))["type"] == "ack"
        answer = ask(sock, s.line("pause", req_id=3))
        assert answer["type"] == "error" and "3 commands are waiting" in answer["message"]
        sock.close()
        for item in s.queue.drain():  # the boundary comes: the commands run, their slots free
            item.reply.done(fake_answers.answer(item))
        wait_until(lambda: s.server.stats()["pending"] == 0)
        assert s.server.stats()["connections"] == 0
    finally:
        s.close()


def test_a_prompt_longer_than_the_context_is_refused_at_once_with_the_limit(tmp_path):
    tokenizer = build_tokenizer(["abc"])
    model = type("Model", (), {"config": default_model_config(tokenizer.vocab_size)})()
    assert context_tokens(model, tokenizer) == 256

    # the prompt is counted as the handler builds it (BOS first; chat template for messages)
    limit = PromptLimit.of(model, tokenizer, handlers.prompt_text, lambda: 64)
    s = Served(tmp_path / "run", admit=limit)
    try:
        sock = s.connect()
        long_chat = [{"role": "user", "content": "b" * 300}]
        for args, expected in (({"prompt": "a" * 100_000}, "has 100000 characters, far more than the model's "
                                                           "context of 256 tokens"),
                               ({"prompt": "a" * 300}, "is 301 tokens, and the model's context is 256"),
                               ({"messages": long_chat}, "and the model's context is 256")):
            answer = ask(sock, s.line("generate", **args))
            assert answer["type"] == "error" and expected in answer["message"], answer
        # a prompt that fits gets its answer capped to the room left: 256 - 1 - 250 = 5 tokens
        sock.sendall(s.line("generate", "capped", prompt="a" * 250, max_new_tokens=100) +
                     s.line("generate", "fits", prompt="a" * 10))
        with sock.makefile("rb") as reader:
            got = [json.loads(reader.readline()) for _ in range(4)]
        assert sorted((m["id"], m["type"]) for m in got) == [("capped", "ack"), ("capped", "done"),
                                                             ("fits", "ack"), ("fits", "done")]
        assert [args["max_new_tokens"] for _, args in s.executed[:1]] == [5]
        assert "max_new_tokens" not in s.executed[1][1]  # fits: left to the run's default
        sock.close()
    finally:
        s.close()


def test_a_long_backlog_reaches_a_reader_whole_and_in_order(served):
    blob = "y" * 2000
    for step in range(3000):  # ~6 MB: several turns of the loop for this one subscriber
        served.events.emit({"type": "train", "step": step, "blob": blob})
    client = RunClient.connect(served.folder.root, timeout=10)
    lines = []
    for event in client.events(from_line=0):
        lines.append(event["line"])
        if event["step"] == 2999:
            break
    assert lines == list(range(3000))
    assert client.status().control["dropped"] == []
    client.close()
