"""Small limits of the control plane's edges: a number too large for any float is a refusal that
names the field, and the chat page's HTTP server drops a half-sent request after its read
timeout and serves at most PAGE_THREADS requests at once (the rest get 503 at once)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from contract.protocol.base import ProtocolError
from contract.protocol.commands import parse_command
from contract.run_folder import RunFolder
from engine.control import chat_page
from engine.control.pending import CommandQueue
from engine.control.server import ControlServer
import fake_answers


@pytest.mark.parametrize("name", ["lr", "grad_clip", "save_every_n_steps"])
def test_a_400_digit_number_is_refused_naming_its_field(name):
    message = json.loads('{"id": 1, "cmd": "set", "args": {"%s": %s}}' % (name, "9" * 400))
    with pytest.raises(ProtocolError, match=f"set: argument '{name}'"):
        parse_command(message)


@pytest.fixture
def page(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_page._PageHandler, "timeout", 1.0)
    folder = RunFolder(tmp_path / "run").create()
    server = ControlServer(folder, CommandQueue(), fake_answers.status)
    server.start()
    served = chat_page.ChatPage(server).start()
    yield served
    served.close()
    server.close()


def _address(page: chat_page.ChatPage) -> tuple[str, int]:
    return page._http.server_address[:2]


def test_a_half_sent_request_is_dropped_after_the_read_timeout(page):
    with socket.create_connection(_address(page), timeout=30) as s:
        s.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n")  # never finished
        assert s.recv(1024) == b""  # closed by the server after 1 s (this client would wait 30)
    _wait_for(lambda: page._http._slots._value == chat_page.PAGE_THREADS)  # its thread is gone


def _wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_requests_past_the_thread_bound_get_503_at_once(page, monkeypatch):
    monkeypatch.setattr(chat_page._PageHandler, "timeout", 30.0)  # the stuck ones stay stuck
    stuck = [socket.create_connection(_address(page), timeout=30) for _ in range(chat_page.PAGE_THREADS)]
    try:
        for s in stuck:
            s.sendall(b"GET /api/status HTTP/1.1\r\n")           # each holds a thread, unfinished
        _wait_for(lambda: page._http._slots._value == 0)
        with socket.create_connection(_address(page), timeout=30) as extra:
            extra.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n\r\n")
            assert extra.recv(1024).startswith(b"HTTP/1.1 503")
    finally:
        for s in stuck:
            s.close()
    _wait_for(lambda: page._http._slots._value == chat_page.PAGE_THREADS)  # every thread gave its slot back
