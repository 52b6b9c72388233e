"""The connection of a RunClient to a run: its address and key (control.json / viewer.json),
one socket for commands with a reader thread that parses every line once into its frame model
(contract.protocol.frames) and hands each answering frame to the sink of the request it belongs to, reconnecting after a lost connection, and fresh sockets for event
streams. The verbs (pause, set, teach ...) are supervisor.client's; this file knows messages, not
commands' meanings. Torch-free."""

from __future__ import annotations

import itertools
import json
import os
import queue
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Protocol

from contract.events import run_state
from contract.protocol.base import Command, ProtocolError
from contract.protocol.frames import Done, Error, Frame, parse_frame
from contract.protocol.roles import Role
from contract.protocol.states import RunState
from contract.protocol.wire import encode
from contract.run_folder import RunFolder, read_events
from supervisor.restart import RELAUNCH_WAIT_S, relaunch_may_come

TERMINAL_STATES = tuple(s.value for s in RunState if s.final)


class Answers(Protocol):
    """Where the messages answering one request go (a queue.Queue, or an event loop's hand-over)."""

    def put(self, message: Frame) -> None: ...


class CommandError(RuntimeError):
    """The run refused a command or it failed; nothing was changed by it."""


class RunGone(ConnectionError):
    """The run's control server is not there (the run ended, or never started)."""


def next_answer(answers: "queue.Queue[Frame]", timeout: float | None) -> Frame:
    try:
        return answers.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"no answer from the run within {timeout} s") from None


class Connection:
    """One run's address, key and command socket. Thread-safe: several threads may send at once."""

    def __init__(self, run_dir: str | Path, connect_timeout: float = 60.0, role: Role | None = None,
                 address: str | Path | None = None):
        self.folder = RunFolder(Path(run_dir))
        self.connect_timeout = connect_timeout
        self.role, self.address = role, None if address is None else Path(address)
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[socket.socket, Answers]] = {}
        self._sock: socket.socket | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    @property
    def connected(self) -> bool:
        """Whether the connection to the run is open now (sending then never waits to connect)."""
        return self._sock is not None

    def open_now(self) -> None:
        """Connect now (waiting up to connect_timeout for the run's server)."""
        with self._lock:
            self._ensure_connected()

    def subscribe(self, command: Command, timeout: float | None) -> Iterator[Frame]:
        """A fresh connection sending `command` (a subscribe): every frame it gets back, until
        the connection ends. Raises RunGone when there is no server to connect to."""
        sock = self._open(timeout)
        try:
            sock.sendall(encode(self._message(command)))
            yield from _lines(sock)
        finally:
            sock.close()

    def _message(self, command: Command) -> dict:
        return {"token": self._address()["token"], "id": f"{self._prefix}-{next(self._ids)}",
                **command.to_wire()}

    def request(self, command: Command, answers: Answers | None = None) -> "queue.Queue[Frame]":
        """Send `command`; its answer's frames go to `answers`, else to a new queue (returned)."""
        mine: queue.Queue[Frame] = queue.Queue()
        sink: Answers = mine if answers is None else answers
        with self._lock:
            sock = self._ensure_connected()
            message = self._message(command)
            try:
                self._waiting[message["id"]] = (sock, sink)
                sock.sendall(encode(message))
            except OSError:  # the run went away since the last call: one fresh try
                self._drop_connection()
                sock = self._ensure_connected()
                message["token"] = self._address()["token"]
                self._waiting[message["id"]] = (sock, sink)
                sock.sendall(encode(message))
        return mine

    def _ensure_connected(self) -> socket.socket:
        if self._sock is None:
            self._sock = self._open(self.connect_timeout)
            threading.Thread(target=self._read_loop, args=(self._sock,), name="run-client-reader",
                             daemon=True).start()
        return self._sock

    def _drop_connection(self) -> None:
        if self._sock is not None:
            try:  # shutdown first: the reader thread's makefile keeps the socket open otherwise
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def _read_loop(self, sock: socket.socket) -> None:
        """Route each answer to the queue of the request it belongs to."""
        try:
            for frame in _lines(sock):
                req_id = str(frame.id)
                with self._lock:
                    waiting = self._waiting.get(req_id)
                    if isinstance(frame, (Done, Error)):
                        self._waiting.pop(req_id, None)
                if waiting is not None:
                    waiting[1].put(frame)
        except (OSError, ValueError, ProtocolError):
            pass
        with self._lock:  # every request sent on this connection learns its answer will not come
            if self._sock is sock:
                self._sock = None
            ids = [k for k, (s, _) in self._waiting.items() if s is sock]
            lost = [self._waiting.pop(k)[1] for k in ids]
        for answers in lost:
            answers.put(Error(lost=True, message="the connection to the run was lost before the answer came"))

    def _address_file(self) -> Path:
        """The file this client takes its address and key from (see the module's docstring)."""
        if self.address is not None:
            return self.address
        if self.role is Role.VIEWER:
            return self.folder.viewer
        if self.role is None and not os.access(self.folder.control, os.R_OK) and self.folder.control.exists():
            return self.folder.viewer  # another user's run, shared with us as a viewer
        return self.folder.control

    def key_role(self) -> Role:
        """The role of the key this client sends (what the run will let it do)."""
        path = self._address_file()
        if path == self.folder.control:
            return Role.OPERATOR
        try:
            return Role(json.loads(path.read_text()).get("role", Role.OPERATOR.value))
        except (OSError, ValueError):
            return self.role or Role.VIEWER

    def _address(self) -> dict:
        path = self._address_file()
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            raise RunGone(f"no control server for {self.folder.root} ({self.logged_state()})") from None
        except PermissionError:
            hint = "; a viewer connects with role=Role.VIEWER (viewer.json)" if path == self.folder.control else ""
            raise CommandError(f"cannot read {path}: permission denied{hint}") from None

    def _open(self, timeout: float | None) -> socket.socket:
        """A new connection to the run's server, retrying while the run may still come: until
        `timeout`, or with None for as long as its launcher or its server process lives."""
        deadline = None if timeout is None else time.monotonic() + timeout
        gone_since: float | None = None  # when no process of the run was first seen alive
        while True:
            try:
                address = self._address()
                if _alive(address.get("pid")):
                    sock = socket.create_connection((address["host"], address["port"]), timeout=10.0)
                    # a request sent while the last one's bytes are unacknowledged goes out at once
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return sock
                problem = f"the run's server process {address.get('pid')} has exited"
            except RunGone as e:
                problem = str(e)
            except OSError as e:
                problem = f"cannot reach the run's control server: {e}"
            if deadline is not None and time.monotonic() >= deadline:
                raise RunGone(f"{problem} (run state: {self.logged_state()})")
            if not self._may_come_back(unknown=deadline is not None):
                # none of its processes lives; a restart's group may still come (supervisor.restart)
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > RELAUNCH_WAIT_S or not relaunch_may_come(self.folder):
                    raise RunGone(f"{problem} (run state: {self.logged_state()})")
            else:
                gone_since = None
            time.sleep(0.2)

    def _may_come_back(self, unknown: bool) -> bool:
        """Whether the run's server can still answer: one of its processes lives (a run resumed
        in the same folder counts, whatever the log says of the last one), or, with none found,
        the log does not say it ended and `unknown` (a folder with no trace of a process yet)."""
        traces = [_pid_in(self.folder.root / "launcher.pid")]
        try:
            traces.append(json.loads(self._address_file().read_text()).get("pid"))
        except (OSError, json.JSONDecodeError):
            pass
        traces = [pid for pid in traces if isinstance(pid, int)]
        if any(_alive(pid) for pid in traces):
            return True
        return unknown and not traces and self.logged_state() not in TERMINAL_STATES

    def logged_state(self) -> str:
        """The run's state as its event log tells it ("not started" before any)."""
        state = run_state(read_events(self.folder.events))
        return "not started" if state is None else state.value

    def close(self) -> None:
        with self._lock:
            self._drop_connection()


def _lines(sock: socket.socket) -> Iterator[Frame]:
    """The frames arriving on `sock`, until the server ends the connection."""
    sock.settimeout(None)
    reader = sock.makefile("rb")
    try:
        for raw in reader:
            if raw.strip():
                yield parse_frame(json.loads(raw))
    finally:
        reader.close()


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child nobody has waited for yet is a zombie: gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
