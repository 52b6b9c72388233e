"""The tiny chat page of `Trainer(server=True)`: a script user's own run, chatted with in a browser.

Served on rank 0 by the standard library's http.server (no web framework), on loopback. Every
request goes through `ControlServer.submit`, the very path a socket client's command takes, so
answers come from the live weights at a step boundary. The page's URL carries the run token;
every API call sends it back and is refused without it.

    GET  /?token=T           the page
    POST /api/generate       {"prompt" | "messages", ...params} -> the answer, streamed as text
    POST /api/command        {"cmd": "pause" | "resume" | ..., "args": {}} -> the JSON result
    GET  /api/status         -> JSON
"""

from __future__ import annotations

import hmac
import itertools
import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from engine.control.server import ControlServer
from contract.protocol.commands import parse_command
from contract.protocol.frames import Ack, Done, Error, Frame, Token, parse_frame
from contract.protocol.wire import MAX_MESSAGE_BYTES
from contract.protocol.base import ProtocolError

ANSWER_TIMEOUT_S = 3600.0  # a paused-then-resumed run can take long to reach a boundary
READ_TIMEOUT_S = 10.0      # a client that sends half a request and then nothing is dropped
PAGE_THREADS = 16          # requests served at once; more are answered 503 at once

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Chat with the model being trained</title>
<style>body{font-family:sans-serif;max-width:46em;margin:2em auto}textarea{width:100%}
pre{white-space:pre-wrap;background:#f4f4f4;padding:.6em;min-height:3em}#status{color:#555}</style>
</head><body>
<h3>Chat with the model being trained</h3>
<div id="status">connecting ...</div>
<textarea id="prompt" rows="3" placeholder="your message"></textarea><br>
<label><input type="checkbox" id="template" checked> chat template</label>
max new tokens <input id="max" type="number" value="64" min="1" style="width:5em">
<button id="send">Send</button> <button id="pause">Pause</button> <button id="resume">Resume</button>
<pre id="answer"></pre>
<script>
const token = new URLSearchParams(location.search).get("token");
const headers = {"Content-Type": "application/json", "X-Token": token};
async function send() {
  const text = document.getElementById("prompt").value;
  const body = {max_new_tokens: parseInt(document.getElementById("max").value)};
  if (document.getElementById("template").checked) body.messages = [{role: "user", content: text}];
  else body.prompt = text;
  const out = document.getElementById("answer");
  out.textContent = "";
  const resp = await fetch("/api/generate", {method: "POST", headers, body: JSON.stringify(body)});
  const reader = resp.body.getReader(), dec = new TextDecoder();
  for (;;) { const {done, value} = await reader.read(); if (done) break; out.textContent += dec.decode(value); }
}
async function command(cmd) {
  const r = await fetch("/api/command", {method: "POST", headers, body: JSON.stringify({cmd})});
  document.getElementById("answer").textContent = JSON.stringify(await r.json());
}
async function status() {
  try {
    const s = await (await fetch("/api/status", {headers})).json();
    const loss = s.last_train ? " loss " + s.last_train.loss.toFixed(4) : "";
    document.getElementById("status").textContent = `${s.state}, step ${s.step}/${s.total_steps}${loss}`;
  } catch (e) { document.getElementById("status").textContent = "run not reachable"; }
}
document.getElementById("send").onclick = send;
document.getElementById("pause").onclick = () => command("pause");
document.getElementById("resume").onclick = () => command("resume");
status(); setInterval(status, 2000);
</script></body></html>
"""


class _PageHandler(BaseHTTPRequestHandler):
    server: "_PageServer"
    timeout = READ_TIMEOUT_S  # the connection's socket timeout (StreamRequestHandler)

    def log_message(self, format, *args) -> None:  # keep the training log clean
        return

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/":
            if not self._token_ok(parse_qs(url.query).get("token", [""])[0]):
                return self._reply(403, "text/plain", b"wrong or missing token (see control.json)")
            return self._reply(200, "text/html; charset=utf-8", PAGE.encode())
        if url.path == "/api/status":
            return self._command("status", {})
        self._reply(404, "text/plain", b"not found")

    def do_POST(self) -> None:
        body = self._body()
        if body is None:
            return
        path = urlparse(self.path).path
        if path == "/api/generate":
            return self._generate(body)
        if path == "/api/command" and isinstance(body.get("cmd"), str):
            return self._command(body["cmd"], body.get("args", {}))
        self._reply(404, "text/plain", b"not found")

    # -- pieces ----------------------------------------------------------------------------------
    def _body(self) -> dict | None:
        # read the whole request first: closing on unread bytes resets the connection, and the
        # client would never see the refusal
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(min(length, MAX_MESSAGE_BYTES + 1))
        remaining = length - len(raw)
        while remaining > 0:  # an oversized body is read and dropped, never kept
            chunk = self.rfile.read(min(65536, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
        if not self._token_ok(self.headers.get("X-Token", "")):
            self._reply(403, "application/json", b'{"error": "wrong or missing token"}')
            return None
        if length > MAX_MESSAGE_BYTES:
            self._reply(413, "application/json", b'{"error": "request too large"}')
            return None
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            self._reply(400, "application/json", json.dumps({"error": f"malformed JSON: {e}"}).encode())
            return None
        if not isinstance(body, dict):
            self._reply(400, "application/json", b'{"error": "the body must be a JSON object"}')
            return None
        return body

    def _submit(self, cmd: str, args: dict) -> "queue.Queue[dict]":
        answers: queue.Queue[dict] = queue.Queue()
        req_id, command = parse_command({"id": f"page-{next(self.server.ids)}", "cmd": cmd, "args": args})
        self.server.control.submit(req_id, command, answers.put)
        return answers

    def _generate(self, args: dict) -> None:
        try:
            answers = self._submit("generate", args)
        except ProtocolError as e:
            return self._reply(400, "text/plain; charset=utf-8", str(e).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        for frame in _until_final(answers):
            if isinstance(frame, Token) and frame.model == "current":
                self.wfile.write(frame.text.encode())
                self.wfile.flush()
            elif isinstance(frame, Error):
                self.wfile.write(f"\n[error: {frame.message}]".encode())

    def _command(self, cmd: str, args: dict) -> None:
        if cmd == "status" and not self._token_ok(self.headers.get("X-Token", "")):
            return self._reply(403, "application/json", b'{"error": "wrong or missing token"}')
        try:
            answers = self._submit(cmd, args if isinstance(args, dict) else {})
        except ProtocolError as e:
            return self._reply(400, "application/json", json.dumps({"error": str(e)}).encode())
        final = list(_until_final(answers))[-1]
        payload = final.result if isinstance(final, Done) else {"error": getattr(final, "message", "")}
        self._reply(200 if isinstance(final, Done) else 409, "application/json", json.dumps(payload).encode())

    def _token_ok(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self.server.control.token.encode())

    def _reply(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _until_final(answers: "queue.Queue[dict]") -> Iterator[Frame]:
    """The frames of one request up to its done / error (acks skipped)."""
    while True:
        try:
            frame = parse_frame(answers.get(timeout=ANSWER_TIMEOUT_S))
        except queue.Empty:
            yield Error(message="no answer in time")
            return
        if not isinstance(frame, Ack):
            yield frame
        if isinstance(frame, (Done, Error)):
            return


class _PageServer(ThreadingHTTPServer):
    """A thread per request, at most PAGE_THREADS of them: past that a request gets 503."""
    daemon_threads = True
    block_on_close = False
    control: ControlServer
    ids: itertools.count

    def __init__(self, address, handler) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(PAGE_THREADS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\nRetry-After: 1\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class ChatPage:
    """The page's HTTP server; `url` includes the token."""

    def __init__(self, control: ControlServer, host: str = "127.0.0.1", port: int = 0):
        self._http = _PageServer((host, port), _PageHandler)
        self._http.control, self._http.ids = control, itertools.count()
        self.url = f"http://{host}:{self._http.server_address[1]}/?token={control.token}"
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="chat-page", daemon=True)

    def start(self) -> "ChatPage":
        self._thread.start()
        return self

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
