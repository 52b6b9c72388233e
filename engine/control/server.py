"""The control server: rank 0's socket listener. Torch-free; it never touches the model.

One thread runs an asyncio event loop that serves every connection: no thread per client, and
the training thread never waits on one. Clients send newline-delimited JSON (contract.protocol);
the server checks the run token (constant-time) and the role it grants, validates the command
and either answers at once (`status`, `subscribe`) or queues it for the next step boundary, where
the training thread executes it on every rank. Whatever the training thread sends back (acks,
streamed tokens, results) is handed to the loop (`call_soon_threadsafe`, which never blocks) and
buffered there.
Subscribers are fed from events.jsonl itself, woken on every emit: the line numbers are the
file's, so a client that resumes at `from_line` gets no gap and no duplicate, and a subscriber
that reads slowly is simply fed later — the file is its backlog, not rank 0's memory.

Two tokens, two files, both mode 0600 and rewritten at each start: control.json holds the
operator's token (every command), viewer.json the viewer's (only the commands whose class says
`role = Role.VIEWER`: generate, complete, status, subscribe, branches, inbox). A viewer is given
viewer.json (copied to them, or read by a process that may not read control.json, e.g. the OpenAI
API), never control.json; an operator command sent with the viewer's token is refused before it is
queued, with contract.protocol.roles.refusal's sentence.

One client's connection (reading, back-pressure, timeouts) is engine.control.connection's. The
limits (connections, timeouts, send buffers, pending commands, prompt length) are stated, and
defined, in engine.control.limits.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

import psutil

from engine.control.connection import Connection
from engine.control.pending import CommandQueue, QueueClosed, Reply, Sink
from engine.control.limits import CLOSE_GRACE_S, LISTEN_BACKLOG, MAX_ID_CHARS, FEED_TURN_BYTES, SWEEP_S, Limits
from contract.protocol.answers import StatusAnswer
from contract.protocol.commands import Subscribe, parse_command
from contract.protocol.frames import Ack, event_frame_bytes
from contract.protocol.wire import decode, encode
from contract.protocol.base import Command, ProtocolError
from contract.protocol.roles import Role, refusal
from contract.run_folder import EventTail, RunFolder, write_private_json

class ControlServer:
    """Rank 0's listener. `status_fn()` answers `status` at once (on the server thread);
    `on_queued(pending)` is told of every queued command (it records the event);
    `admit(command) -> command` may refuse a command (raise) or adjust it before it is queued
    (`PromptLimit`)."""

    def __init__(self, folder: RunFolder, commands: CommandQueue, status_fn: Callable[[], StatusAnswer],
                 host: str = "127.0.0.1", port: int = 0,
                 on_queued: Callable[[Any], None] | None = None,
                 admit: Callable[[Command], Command] | None = None, **limits: float):
        self.folder, self.commands, self.status_fn, self.on_queued = folder, commands, status_fn, on_queued
        self.admit, self.limits = admit, Limits(**limits)
        self.token = secrets.token_urlsafe(32)         # the operator's: control.json
        self.viewer_token = secrets.token_urlsafe(32)  # the viewer's: viewer.json
        self.clients: set[Connection] = set()
        self.pending = self.accepted = self.refused = 0
        self.dropped: deque[dict] = deque(maxlen=16)
        self.closing = False
        self._feed_scheduled = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(LISTEN_BACKLOG)
        self.host, self.port = self._sock.getsockname()[:2]
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="control-server", daemon=True)
        self._listener: asyncio.AbstractServer | None = None
        self._native_id = 0  # the loop thread's, for its CPU time in `stats`

    def start(self) -> "ControlServer":
        ready = threading.Event()
        self.loop.call_soon(ready.set)
        self._thread.start()
        ready.wait()
        self.write_control_file()
        return self

    def _run(self) -> None:
        self._native_id = threading.get_native_id()
        asyncio.set_event_loop(self.loop)
        self._listener = self.loop.run_until_complete(
            self.loop.create_server(lambda: Connection(self), sock=self._sock, backlog=LISTEN_BACKLOG))
        self.loop.call_later(SWEEP_S, self._sweep)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def write_control_file(self, **extra: Any) -> None:
        """control.json (mode 0600): address, operator token, pid, and `extra` (the chat page's
        URL, which carries the operator token); viewer.json (0600): the same with the viewer's
        token, written first, so that whoever sees control.json finds viewer.json too."""
        address = {"host": self.host, "port": self.port, "pid": os.getpid()}
        write_private_json(self.folder.viewer, {**address, "token": self.viewer_token, "role": Role.VIEWER.value})
        write_private_json(self.folder.control, {**address, "token": self.token, **extra})

    def stats(self) -> dict[str, Any]:
        """Connections now and since the start, refusals, recent drops and the limits."""
        return {"connections": len(self.clients), "accepted": self.accepted, "refused": self.refused,
                "pending": self.pending, "buffered_bytes": self._buffered(), "dropped": self._recent_drops(),
                "cpu_s": self._cpu_s(), "limits": self.limits.as_dict()}

    def _cpu_s(self) -> float | None:
        """CPU seconds the server's thread has used (what serving clients has cost rank 0)."""
        for thread in psutil.Process().threads():
            if thread.id == self._native_id:
                return round(thread.user_time + thread.system_time, 3)
        return None

    def _buffered(self) -> int:
        """Bytes waiting in rank 0's send buffers, all clients together."""
        try:
            return sum(c.transport.get_write_buffer_size() for c in list(self.clients) if c.transport)
        except RuntimeError:  # the set changed while another thread read it
            return -1

    def _recent_drops(self) -> list[dict]:
        try:
            return list(self.dropped)
        except RuntimeError:  # appended to by the loop thread while another thread read it
            return []

    # -- requests (loop thread) ----------------------------------------------------------------------
    def handle_line(self, line: bytes, conn: Connection) -> None:
        try:
            msg = decode(line)
        except ProtocolError as e:
            return conn.send_error(None, str(e))
        except (RecursionError, ValueError) as e:  # nesting too deep; an integer of > 4300 digits
            return conn.send_error(None, f"malformed JSON: {type(e).__name__}: {str(e)[:200]}")
        raw_id = msg.get("id") if isinstance(msg, dict) else None
        raw_id = raw_id if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else None
        if isinstance(raw_id, str) and len(raw_id) > MAX_ID_CHARS or isinstance(raw_id, int) and \
                abs(raw_id) >= 1 << 63:
            return conn.send_error(None, f"field `id` must be at most {MAX_ID_CHARS} characters "
                                         "(or a 64-bit integer)")
        raw_id = None if raw_id is None else str(raw_id)  # as parse_command names it: frames carry text
        role = self._role_of(msg.get("token")) if isinstance(msg, dict) else None
        if role is None:
            return conn.send_error(raw_id, "refused: missing or wrong token (see control.json, or viewer.json "
                                           "for a viewer)")
        try:
            req_id, command = parse_command(msg)
        except ProtocolError as e:
            return conn.send_error(raw_id, str(e))
        except (ValueError, TypeError, OverflowError, RecursionError) as e:  # e.g. 10**400 as lr
            return conn.send_error(raw_id, f"refused: {str(msg.get('cmd'))[:40]}: an argument is out of "
                                           f"range ({type(e).__name__}: {str(e)[:200]})")
        if not role.may(command.role):
            return conn.send_error(req_id, refusal(command.name, role))
        conn.ids.append(req_id)
        if isinstance(command, Subscribe):
            return self._subscribe(conn, req_id, command.from_line)
        if self.pending >= self.limits.max_pending:
            return conn.send_error(req_id, f"refused: {self.pending} commands are waiting for the "
                                           f"next step boundary (the limit); try again later")
        conn.pending += 1
        self.pending += 1
        self.submit(req_id, command, conn.enqueue)

    def submit(self, req_id: str, command: Command, sink: Sink) -> None:
        """Answer or queue a validated command; in-process front ends (the chat page) call this
        directly, so they go through exactly the path a socket client does."""
        reply = Reply(req_id, sink, command.returns)
        if self.admit is not None:
            try:
                command = self.admit(command)
            except Exception as e:  # noqa: BLE001 - a refused command is answered, never raised
                return reply.error(str(e) or type(e).__name__)
        if command.answered_at_once:
            try:
                return reply.done(self.status_fn().model_copy(update={"control": self.stats()}))
            except Exception as e:  # noqa: BLE001 - a status snapshot must never kill the server
                return reply.error(f"status failed: {type(e).__name__}: {e}")
        try:
            pending = self.commands.put(req_id, command, reply)
        except QueueClosed as e:
            return reply.error(str(e))
        if self.on_queued is not None:
            self.on_queued(pending)

    def _role_of(self, token: Any) -> Role | None:
        """The role `token` grants (both compared in constant time), or None for a wrong one."""
        if not isinstance(token, str):
            return None
        operator = hmac.compare_digest(token.encode(), self.token.encode())
        viewer = hmac.compare_digest(token.encode(), self.viewer_token.encode())
        return Role.OPERATOR if operator else Role.VIEWER if viewer else None

    # -- events ----------------------------------------------------------------------------------
    def notify(self, event: dict | None = None) -> None:
        """An event was written (the event log calls this, from any thread): feed subscribers."""
        if self._feed_scheduled or self.loop.is_closed():
            return
        self._feed_scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._feed_all)
        except RuntimeError:  # closed in between
            pass

    def _subscribe(self, conn: Connection, req_id: str, from_line: int) -> None:
        if conn.events is not None:
            return conn.send_error(req_id, "refused: this connection is already subscribed; open another")
        conn.write(encode(Ack(id=req_id, queued=0).wire()))
        conn.events = EventTail(self.folder.events, from_line)
        self.feed(conn)

    def _feed_all(self) -> None:
        self._feed_scheduled = False
        for conn in list(self.clients):
            self.feed(conn)

    def feed(self, conn: Connection) -> None:
        """Send `conn` the event lines it has not had, while its buffer is under the high-water mark."""
        transport, sent = conn.transport, 0
        while conn.open and conn.events is not None and transport is not None and not conn.stalled_since:
            if sent >= FEED_TURN_BYTES:  # a long backlog to a fast reader: the other clients' turn
                self.loop.call_soon(self.feed, conn)
                return
            lines = conn.events.read()
            if not lines:
                return
            data = b"".join(event_frame_bytes(n, raw) for n, raw in lines)
            sent += len(data)
            conn.write(data)

    def _sweep(self) -> None:
        now = time.monotonic()
        for conn in list(self.clients):
            if conn.open:
                conn.check_timeouts(now)
        self._feed_all()  # lines written by other processes, or by a feed that was held back
        if not self.closing:
            self.loop.call_later(SWEEP_S, self._sweep)

    def disconnect_all(self) -> None:
        """Cut every connection now (clients reconnect; tests use it to show nothing is lost)."""
        def cut() -> None:
            for conn in list(self.clients):
                conn.open = False
                if conn.transport is not None:
                    conn.transport.abort()
        self.loop.call_soon_threadsafe(cut)

    # -- shutting down ---------------------------------------------------------------------------
    def close(self, grace: float = CLOSE_GRACE_S) -> None:
        """Feed subscribers what is left, give every client `grace` s in all to take it, cut the
        rest, stop listening, remove control.json. Never waits longer on any client."""
        if self._thread.is_alive() and not self.loop.is_closed():
            done = asyncio.run_coroutine_threadsafe(self._shut(grace), self.loop)
            try:
                done.result(timeout=grace + 5.0)
            except Exception:  # noqa: BLE001 - closing goes on whatever the loop did
                pass
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:
                pass
            self._thread.join(timeout=5.0)
        self._sock.close()
        for path in (self.folder.control, self.folder.viewer):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    async def _shut(self, grace: float) -> None:
        self.closing = True
        if self._listener is not None:
            self._listener.close()
        self._feed_all()
        for conn in list(self.clients):
            conn.close()
        deadline = time.monotonic() + grace
        while self.clients and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.clients):
            if conn.transport is not None:
                conn.transport.abort()
        await asyncio.sleep(0)  # let the aborts' connection_lost callbacks run
