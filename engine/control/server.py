"""The control server: rank 0's socket thread. Torch-free; it never touches the model.

Each client connection gets a thread that reads newline-delimited JSON (contract.protocol), checks
the run token (constant-time), validates the command and then either answers at once (`status`,
`subscribe`) or queues it for the next step boundary, where the training thread executes it on
every rank. Whatever the training thread sends back (acks, streamed tokens, results) goes through
the connection's own writer thread, so a slow or vanished client never stalls training.

Subscribers are fed from events.jsonl itself, woken by the event log on every emit: the line
numbers are the file's, so a client that resumes at `from_line` gets no gap and no duplicate.
"""

from __future__ import annotations

import hmac
import json
import os
import queue
import secrets
import socket
import socketserver
import threading
from pathlib import Path
from typing import Any, Callable

from engine.control.pending import CommandQueue, QueueClosed, Reply, Sink
from contract.protocol import MAX_MESSAGE_BYTES, ProtocolError, check_command, decode, encode
from contract.run_folder import RunFolder, write_private_json


class Connection:
    """One client socket: a writer thread sends queued messages; `send_now` writes directly
    (subscription threads, which may block on a slow reader without holding anyone else up)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.open = True
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="control-writer", daemon=True)
        self._writer.start()

    def enqueue(self, message: dict) -> None:
        if not self.open:
            raise ConnectionError("client disconnected")
        self._out.put(message)

    def send_now(self, message: dict) -> None:
        with self._lock:
            self.sock.sendall(encode(message))

    def _write_loop(self) -> None:
        while True:
            message = self._out.get()
            if message is None:
                return
            try:
                self.send_now(message)
            except OSError:
                self.open = False
                return

    def close(self) -> None:
        """Send what is queued, then end the connection (the client sees end of stream)."""
        self._out.put(None)
        self._writer.join(timeout=5.0)
        self.open = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class EventLines:
    """events.jsonl from line `start` on, as (line number, event); partial last lines wait."""

    def __init__(self, path: Path, start: int = 0):
        self.path, self.start, self.line, self.offset = Path(path), start, 0, 0

    def poll(self) -> list[tuple[int, dict]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        out = []
        for raw in chunk[:end].splitlines():
            n, self.line = self.line, self.line + 1
            if n < self.start:
                continue
            try:
                out.append((n, json.loads(raw)))
            except json.JSONDecodeError:  # keep the numbering; a broken line is just not sent
                continue
        self.offset += end
        return out


class _Handler(socketserver.StreamRequestHandler):
    server: "_TCPServer"

    def handle(self) -> None:
        conn = Connection(self.connection)
        control = self.server.control
        control.connections.add(conn)
        try:
            while True:
                line = self.rfile.readline(MAX_MESSAGE_BYTES + 1)
                if not line:
                    return
                if len(line) > MAX_MESSAGE_BYTES and not line.endswith(b"\n"):
                    self._skip_rest_of_line()
                    _send_error(conn, None, f"message larger than {MAX_MESSAGE_BYTES} bytes refused")
                    continue
                if line.strip():
                    control.handle_line(line, conn)
        except OSError:
            return
        finally:
            conn.open = False
            control.connections.discard(conn)

    def _skip_rest_of_line(self) -> None:
        while True:
            more = self.rfile.readline(1 << 16)
            if not more or more.endswith(b"\n"):
                return


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    control: "ControlServer"


def _send_error(conn: Connection, req_id: Any, message: str) -> None:
    try:
        conn.enqueue({"type": "error", "id": req_id, "message": message})
    except ConnectionError:
        pass


class ControlServer:
    """Rank 0's listener. `status_fn()` answers `status` at once (from the server thread);
    `on_queued(pending)` is told of every queued command (it records the event)."""

    def __init__(self, folder: RunFolder, commands: CommandQueue, status_fn: Callable[[], dict],
                 host: str = "127.0.0.1", port: int = 0,
                 on_queued: Callable[[Any], None] | None = None):
        self.folder, self.commands, self.status_fn, self.on_queued = folder, commands, status_fn, on_queued
        self.token = secrets.token_urlsafe(32)
        self.connections: set[Connection] = set()
        self._changed = threading.Condition()
        self._version, self._closing = 0, False
        self._subscribers: list[threading.Thread] = []
        _TCPServer.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._tcp = _TCPServer((host, port), _Handler)
        self._tcp.control = self
        self.host, self.port = self._tcp.server_address[:2]
        self._thread = threading.Thread(target=self._tcp.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="control-server", daemon=True)

    def start(self) -> "ControlServer":
        self._thread.start()
        self.write_control_file()
        return self

    def write_control_file(self, **extra: Any) -> None:
        """control.json (mode 0600): address, token, pid, and `extra` (the chat page's URL)."""
        write_private_json(self.folder.control, {"host": self.host, "port": self.port,
                                                 "token": self.token, "pid": os.getpid(), **extra})

    # -- requests --------------------------------------------------------------------------------
    def handle_line(self, line: bytes, conn: Connection) -> None:
        try:
            msg = decode(line)
        except ProtocolError as e:
            return _send_error(conn, None, str(e))
        raw_id = msg.get("id") if isinstance(msg, dict) else None
        raw_id = raw_id if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else None
        if not isinstance(msg, dict) or not self._token_ok(msg.get("token")):
            return _send_error(conn, raw_id, "refused: missing or wrong token (see control.json)")
        try:
            req_id, cmd, args = check_command(msg)
        except ProtocolError as e:
            return _send_error(conn, raw_id, str(e))
        if cmd == "subscribe":
            return self._subscribe(conn, req_id, args.get("from_line", 0))
        self.submit(req_id, cmd, args, conn.enqueue)

    def submit(self, req_id: str, cmd: str, args: dict, sink: Sink) -> None:
        """Answer or queue a validated command; in-process front ends (the chat page) call this
        directly, so they go through exactly the path a socket client does."""
        reply = Reply(req_id, sink)
        if cmd == "status" and not args.get("ranks"):
            try:
                return reply.done(self.status_fn())
            except Exception as e:  # noqa: BLE001 - a status snapshot must never kill the server
                return reply.error(f"status failed: {type(e).__name__}: {e}")
        try:
            pending = self.commands.put(req_id, cmd, args, reply)
        except QueueClosed as e:
            return reply.error(str(e))
        if self.on_queued is not None:
            self.on_queued(pending)

    def _token_ok(self, token: Any) -> bool:
        return isinstance(token, str) and hmac.compare_digest(token.encode(), self.token.encode())

    # -- events ----------------------------------------------------------------------------------
    def notify(self, event: dict | None = None) -> None:
        """An event was written (the event log calls this): wake every subscriber."""
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def _subscribe(self, conn: Connection, req_id: str, from_line: int) -> None:
        conn.enqueue({"type": "ack", "id": req_id, "queued": 0})
        thread = threading.Thread(target=self._stream_events, args=(conn, from_line),
                                  name="control-events", daemon=True)
        self._subscribers.append(thread)
        thread.start()

    def _stream_events(self, conn: Connection, from_line: int) -> None:
        lines, seen = EventLines(self.folder.events, from_line), -1
        while conn.open:
            with self._changed:
                if self._version == seen and not self._closing:
                    self._changed.wait(1.0)  # the timeout also catches lines written by others
                seen, closing = self._version, self._closing
            try:
                for n, event in lines.poll():
                    conn.send_now({"type": "event", "line": n, "event": event})
            except OSError:
                conn.open = False
                return
            if closing:
                return

    # -- shutting down ---------------------------------------------------------------------------
    def close(self) -> None:
        """Flush every subscriber, end every connection, stop listening, remove control.json."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        for thread in self._subscribers:
            thread.join(timeout=5.0)
        for conn in list(self.connections):
            conn.close()
        self._tcp.shutdown()
        self._tcp.server_close()
        try:
            self.folder.control.unlink()
        except FileNotFoundError:
            pass
