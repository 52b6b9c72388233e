"""One client of rank 0's control server (engine.control.server), served by the server's asyncio
event loop: reading newline-delimited JSON (a message larger than MAX_MESSAGE_BYTES refused, the
rest of it skipped), writing with back-pressure (a client that stops reading is dropped once
its buffer passes the limits), idle and stall timeouts, and the refusal of a client over the
connection limit. What a message means is the server's (`handle_line`). Torch-free."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from typing import Any, Protocol

from contract.protocol.frames import Error
from contract.protocol.wire import MAX_MESSAGE_BYTES, encode
from contract.run_folder import EventTail
from engine.control.limits import KERNEL_SNDBUF, SEND_HIGH_WATER, Limits

_FINAL = ("done", "error")


class Served(Protocol):
    """What a connection needs of its server (engine.control.server.ControlServer)."""

    loop: asyncio.AbstractEventLoop
    limits: Limits
    clients: set[Any]
    dropped: deque[dict]
    closing: bool
    pending: int
    accepted: int
    refused: int

    def handle_line(self, line: bytes, conn: Connection) -> None: ...

    def feed(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One client, served by the event loop. Everything but `enqueue` runs on the loop thread."""

    def __init__(self, server: Served):
        self.server, self.loop = server, server.loop
        self.transport: asyncio.Transport | None = None
        self.peer, self.open, self.refused = "?", False, False
        self.buf, self.skipping, self.partial_since = bytearray(), False, 0.0
        self.last_heard = self.stalled_since = 0.0
        self.pending, self.eof = 0, False  # commands sent here and not yet answered; half-closed
        self.ids: deque[str] = deque(maxlen=4)
        self.events: EventTail | None = None
        self.last_buffered = 0  # unsent bytes at the last sweep

    # -- asyncio callbacks -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport, self.last_heard = transport, time.monotonic()
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.peer = f"{peer[0]}:{peer[1]}"
        server = self.server
        if len(server.clients) >= server.limits.max_connections or server.closing:
            return self._refuse()
        self.open = True
        server.clients.add(self)
        server.accepted += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_SNDBUF)
        transport.set_write_buffer_limits(high=SEND_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # read and thrown away, so closing never resets the refusal's delivery
        self.last_heard = time.monotonic()
        if self.skipping:  # the rest of a line that was too long
            cut = data.find(b"\n")
            if cut < 0:
                return
            self.skipping, data = False, data[cut + 1:]
        if not self.buf:
            self.partial_since = self.last_heard
        self.buf += data
        while self.open:
            cut = self.buf.find(b"\n")
            if cut < 0:
                break
            line = bytes(self.buf[:cut + 1])
            del self.buf[:cut + 1]
            self.partial_since = self.last_heard
            if cut + 1 > MAX_MESSAGE_BYTES + 1:
                self.send_error(None, f"message larger than {MAX_MESSAGE_BYTES} bytes refused")
            elif line.strip():
                try:
                    self.server.handle_line(line, self)
                except Exception as e:  # noqa: BLE001 - e.g. recording the event failed: say so
                    self.send_error(None, f"the run could not take the message: {type(e).__name__}: {e}")
        if len(self.buf) > MAX_MESSAGE_BYTES:
            self.buf.clear()
            self.skipping = True
            self.send_error(None, f"message larger than {MAX_MESSAGE_BYTES} bytes refused")

    def eof_received(self) -> bool:
        """A half-closed client may still wait for answers (or events): keep writing to it."""
        self.buf.clear()
        self.eof = True
        return not (self.refused or (self.pending == 0 and self.events is None))

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self.server.clients.discard(self)
        self.server.pending -= self.pending  # its answers will not be counted off any more
        self.pending = 0

    def pause_writing(self) -> None:
        self.stalled_since = time.monotonic()

    def resume_writing(self) -> None:
        self.stalled_since = 0.0
        self.server.feed(self)

    # -- writing -----------------------------------------------------------------------------------
    def enqueue(self, message: dict) -> None:
        """Send `message` (any thread; never blocks). Raises ConnectionError once the client is gone."""
        if not self.open:
            raise ConnectionError("client disconnected")
        data = encode(message)
        final = message.get("type") in _FINAL and message.get("id") is not None
        try:
            self.loop.call_soon_threadsafe(self._deliver, data, final)
        except RuntimeError:  # the loop has been closed: the server is gone
            self.open = False
            raise ConnectionError("the control server has closed") from None

    def _deliver(self, data: bytes, final: bool) -> None:
        if final and self.pending > 0:
            self.pending -= 1
            self.server.pending -= 1
        self.write(data)
        if final and self.eof and self.pending == 0 and self.events is None:
            self.close()  # the client half-closed and has every answer it waited for

    def write(self, data: bytes) -> None:
        if not self.open or self.transport is None or self.transport.is_closing():
            return
        self.transport.write(data)
        if self.transport.get_write_buffer_size() > self.server.limits.send_buffer_max:
            self.drop(f"more than {self.server.limits.send_buffer_max} bytes waited to be sent to it")

    def send_error(self, req_id: Any, message: str) -> None:
        self.write(encode(Error(id=req_id, message=message).wire()))

    # -- ending --------------------------------------------------------------------------------------
    def drop(self, why: str) -> None:
        """Disconnect a client that does not keep up; it can read why (last line, and `status`)."""
        if not self.open:
            return
        self.open = False
        where = f"; resubscribe from line {self.events.line}" if self.events is not None else ""
        reason = f"dropped by the run: {why}{where}"
        self.server.dropped.append({"peer": self.peer, "ids": list(self.ids), "reason": reason,
                                    "time": time.time()})
        assert self.transport is not None
        self.transport.write(encode(Error(message=reason).wire()))
        self.transport.close()  # sends what is buffered, then closes; cut after a grace period
        self.loop.call_later(self.server.limits.drop_grace, self.transport.abort)

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()

    def _refuse(self) -> None:
        """Too many connections: say so, half-close, and read until the client hangs up."""
        assert self.transport is not None
        self.refused = True
        self.server.refused += 1
        limit = self.server.limits.max_connections
        message = (f"refused: {limit} connections to this run are open (the limit); "
                   "close one and try again" if not self.server.closing else "refused: the run is ending")
        self.transport.write(encode(Error(message=message).wire()))
        self.transport.write_eof()
        self.loop.call_later(2.0, self.transport.abort)

    def _stalled(self, now: float) -> float:
        """Seconds the buffer has stayed above the high-water mark without shrinking."""
        buffered = self.transport.get_write_buffer_size() if self.transport is not None else 0
        if self.stalled_since and buffered < self.last_buffered:
            self.stalled_since = now  # it is reading, slowly
        self.last_buffered = buffered
        return now - self.stalled_since if self.stalled_since else 0.0

    def check_timeouts(self, now: float) -> None:
        limits = self.server.limits
        if (self.buf or self.skipping) and now - self.partial_since > limits.read_timeout:
            self.buf.clear()
            self.skipping = False
            self.drop(f"no complete message within {limits.read_timeout:g} s of its first byte")
        elif self._stalled(now) > limits.stall_timeout:
            self.drop(f"it took nothing for {limits.stall_timeout:g} s while more than "
                      f"{SEND_HIGH_WATER} bytes waited for it")
        elif self.pending == 0 and self.events is None and now - self.last_heard > limits.idle_timeout:
            self.send_error(None, f"closed: idle for {limits.idle_timeout:g} s; connect again to go on")
            self.close()
