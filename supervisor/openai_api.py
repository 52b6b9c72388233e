"""The live model behind an OpenAI-compatible API: `/v1/models`, `/v1/completions`,
`/v1/chat/completions`, streamed (server-sent events, as OpenAI streams) or not.

Where it lives, and why: a torch-free ASGI app (FastAPI on uvicorn, what Gradio already brings)
in its own process (`./launch.sh serve`, or mounted by any front end), routing each request to a
run through `RunClient`, the path every front end uses. Rank 0 keeps doing one thing (its control
socket, never HTTP parsing or TLS-less exposure), one API serves every live run and chat-only
session of an output folder, and it outlives runs, so a client sees "503: not answering" rather
than a refused connection while a run starts or restarts. Each request becomes one `complete`
command (contract.protocol.completion_commands), executed by every rank at the next step boundary like
a chat: every layout works and the training trajectory is unchanged.

Models: one per live run (its folder name) and per chat-only session of a checkpoint or export
(`<run>@<checkpoint>`, e.g. `my-run@step-40`); `/v1/models` lists those answering now.

Keys: `Authorization: Bearer <key>`. Each run folder keeps its own key in `api_key.json` (mode
0600, beside control.json; made with the run's folder when it starts, kept after it ends); it grants
that run and its name only. The output folder's own `api_key.json` grants every run in it (for
Open WebUI and other tools that list models). A wrong or missing key: 401. Beside each
`api_key.json` (the operator's key) is `api_viewer_key.json` (a viewer's key, also 0600, to hand
out on its own): the API asks only a viewer's rights of a run (`complete` is a viewer's command,
contract.protocol.roles), so both keys work for every endpoint, and the API itself connects to each
run with the run's viewer token (viewer.json): it cannot pause, stop or change a run whatever it is
sent. Delete a key file to revoke its key (a new one is made when the API next looks).

Errors come in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad request,
401 key, 404 unknown model, 413 body over MAX_BODY_BYTES, 429 more than MAX_IN_FLIGHT requests
waiting for one run (or the run's own queue full), with `Retry-After`; 503 the run is not answering.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from contract.protocol.completion_commands import Complete
from contract.protocol.wire import MAX_MESSAGE_BYTES
from contract.protocol.base import ProtocolError
from contract.protocol.roles import Role, refusal
from contract.run_folder import KEY_FILE, VIEWER_KEY_FILE, key_of
from supervisor.client import RunClient, RunGone
from supervisor.openai_models import ChatRequest, CompletionRequest, first_problem
from supervisor.openai_stream import LoopAnswers, Made, RunFailed

MAX_BODY_BYTES = MAX_MESSAGE_BYTES  # what the run's control socket takes in one message
MAX_IN_FLIGHT = 32                  # requests waiting for one run at once; more get 429
CONNECT_TIMEOUT_S = 5.0             # a run that does not take the connection by then: 503
ANSWER_TIMEOUT_S = 600.0            # a run that takes longer to answer: 503
RETRY_AFTER_S = 2                   # a 429's Retry-After: about one payback of the serving budget


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        # a 429 says when to come back, as OpenAI's do (the `openai` client waits that long)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


class _ByMtime:
    """A value read from a file, read again only when the file changes (every request looks up
    names and keys: parsing YAML and JSON each time would cost each answer milliseconds)."""

    def __init__(self, read: Callable[[Path], str]):
        self.read = read
        self._seen: dict[Path, tuple[float, str]] = {}

    def __call__(self, folder: Path, file: str) -> str:
        try:
            mtime = (folder / file).stat().st_mtime
        except FileNotFoundError:
            mtime = -1.0
        seen = self._seen.get(folder)
        if seen is None or seen[0] != mtime:
            seen = (mtime, self.read(folder))
            self._seen[folder] = seen
        return seen[1]


def model_name(run: Path) -> str:
    """A run's model name: its folder name; a chat-only session `<run>@<checkpoint or model>`."""
    try:
        config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return run.name
    control = config.get("control") or {}
    if not control.get("chat_only"):
        return run.name
    source = control.get("chat_load") or config.get("resume") or (config.get("model") or {}).get("path") or ""
    path = Path(str(source))
    if path.parent.name == "checkpoints":
        return f"{path.parent.parent.name}@{path.name}"
    if (path.parent / "config.yaml").is_file():  # a run's own model/ folder
        return f"{path.parent.name}@{path.name}"
    return f"{path.name or run.name}"


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Runs:
    """The runs of an output folder that answer now, by model name, and their clients."""

    def __init__(self, root: Path, max_in_flight: int = MAX_IN_FLIGHT):
        self.root, self.max_in_flight = Path(root), max_in_flight
        self._clients: dict[Path, RunClient] = {}
        self._busy: dict[Path, threading.BoundedSemaphore] = {}
        self._lock = threading.Lock()
        self._names, self._keys = _ByMtime(model_name), _ByMtime(key_of)
        self._viewer_keys = _ByMtime(lambda folder: key_of(folder, VIEWER_KEY_FILE))

    def key(self, folder: Path) -> str:
        """`folder`'s operator key (its viewer key is made with it)."""
        self._viewer_keys(folder, VIEWER_KEY_FILE)
        return self._keys(folder, KEY_FILE)

    def role(self, key: str, folder: Path) -> Role | None:
        """The role `key` has in `folder` (both compared in constant time), None for neither."""
        given = key.encode()  # bytes: a non-ASCII header is a wrong key, not a TypeError
        operator = secrets.compare_digest(given, self.key(folder).encode())
        viewer = secrets.compare_digest(given, self._viewer_keys(folder, VIEWER_KEY_FILE).encode())
        return Role.OPERATOR if operator else Role.VIEWER if viewer else None

    def live(self) -> dict[str, Path]:
        """{model name: run folder} of every run whose control server is up."""
        found: dict[str, Path] = {}
        for control in sorted(self.root.glob("*/control.json")):
            try:
                pid = json.loads(control.read_text()).get("pid")
            except (OSError, json.JSONDecodeError):
                continue
            if _alive(pid):
                found.setdefault(self._names(control.parent, "config.yaml"), control.parent)
        return found

    def granted(self, key: str, needs: Role = Role.VIEWER) -> set[Path] | None:
        """The run folders `key` opens (None: every one, the output folder's key); raises 401,
        or 403 when the key's role may not do what `needs` (every endpoint now: a viewer's)."""
        for folder, grant in ((self.root, None), *((p.parent, {p.parent}) for p in self.root.glob(f"*/{KEY_FILE}"))):
            role = self.role(key, folder) if key else None
            if role is not None:
                if not role.may(needs):
                    raise ApiError(403, refusal("this request", role), "permission_error", code="insufficient_role")
                return grant
        raise ApiError(401, "Incorrect API key provided (see api_key.json in the run folder, or the "
                            "output folder's for every run)", "invalid_request_error", code="invalid_api_key")

    def client(self, run: Path) -> RunClient:
        with self._lock:
            if run not in self._clients:
                # a viewer's token (viewer.json): the API can answer, never change a run
                self._clients[run] = RunClient(run, connect_timeout=CONNECT_TIMEOUT_S, role=Role.VIEWER)
                self._busy[run] = threading.BoundedSemaphore(self.max_in_flight)
            return self._clients[run]

    def slot(self, run: Path) -> threading.BoundedSemaphore:
        self.client(run)
        return self._busy[run]

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def create_app(root: str | Path, max_in_flight: int = MAX_IN_FLIGHT) -> FastAPI:
    """The API over the runs in output folder `root` (each run's keys made with its folder);
    more than `max_in_flight` requests waiting for one run get 429."""
    runs = Runs(Path(root), max_in_flight)
    app = FastAPI(title="livetune OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.runs = runs

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        granted = runs.granted(_bearer(request))
        live = runs.live()
        for run in live.values():
            runs.key(run)  # a new run gets its key as soon as it is listed
        models = [{"id": name, "object": "model", "created": int(run.stat().st_mtime), "owned_by": "livetune"}
                  for name, run in live.items() if granted is None or run in granted]
        return JSONResponse({"object": "list", "data": models})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await _body(request, CompletionRequest)
        return await _answer(runs, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await _body(request, ChatRequest)
        return await _answer(runs, request, body, chat=True)

    return app


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(401, "You didn't provide an API key: send `Authorization: Bearer <key>` "
                            "(api_key.json in the run folder)", code="invalid_api_key")
    return key.strip()


async def _body(request: Request, kind: type[BaseModel]) -> Any:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        return kind.model_validate_json(raw)
    except ValidationError as e:
        where, text = first_problem(e)
        raise ApiError(400, text, param=where or None) from None


def _model(runs: Runs, request: Request, name: str) -> Path:
    granted = runs.granted(_bearer(request))
    run = runs.live().get(name)
    if run is None or (granted is not None and run not in granted):
        raise ApiError(404, f"The model `{name}` does not exist or is not answering now (GET /v1/models "
                            "lists the live runs and chat sessions)", code="model_not_found", param="model")
    runs.key(run)
    return run


async def _answer(runs: Runs, request: Request, body: ChatRequest | CompletionRequest, chat: bool) -> Any:
    run = _model(runs, request, body.model)
    try:
        command = body.command()
    except (ProtocolError, ValueError) as e:
        raise ApiError(400, str(e)) from None
    slot = runs.slot(run)
    if not slot.acquire(blocking=False):
        raise ApiError(429, f"{runs.max_in_flight} requests to `{body.model}` are waiting already; try again later",
                       "rate_limit_error", code="rate_limit_exceeded")
    try:
        answers = await _send(runs.client(run), command)
        first = await _first(answers)
    except BaseException:
        slot.release()
        raise
    made = Made(body.model, chat)
    if not body.stream:
        try:
            await _first(answers, whole=True)
        finally:
            slot.release()
        return JSONResponse(made.response(answers.answer()))
    return StreamingResponse(_released(made.stream(answers, first, command, body.include_usage), slot),
                             media_type="text/event-stream", headers={"Cache-Control": "no-store"})


async def _send(client: RunClient, command: Complete) -> LoopAnswers:
    """Send the command; its answer comes onto this event loop. Only a client that must connect
    first does so on a worker thread (connecting may wait up to CONNECT_TIMEOUT_S)."""
    answers = LoopAnswers(asyncio.get_running_loop(), ANSWER_TIMEOUT_S)
    try:
        if client.connected:
            client.submit(command, answers)  # one small write on an open socket
        else:
            await run_in_threadpool(client.submit, command, answers)
    except (RunGone, OSError) as e:
        raise ApiError(503, f"the run is not answering: {e}", "service_unavailable", code="run_unavailable") from None
    return answers


async def _first(answers: LoopAnswers, whole: bool = False) -> list[str]:
    """The first streamed piece (`whole`: every piece, for an answer that does not stream), as
    OpenAI's error where the run refused it."""
    try:
        if not whole:
            return await answers.first()
        async for _ in answers.texts():
            pass
        return []
    except RunFailed as e:
        raise _refusal(str(e)) from None
    except TimeoutError as e:
        raise ApiError(503, f"the run did not answer in time: {e}", "service_unavailable") from None


def _refusal(message: str) -> ApiError:
    if "commands are waiting" in message:
        return ApiError(429, message, "rate_limit_error", code="rate_limit_exceeded")
    if "has ended" in message or "connection to the run was lost" in message or "not executed" in message:
        return ApiError(503, message, "service_unavailable", code="run_unavailable")
    return ApiError(400, message)


async def _released(chunks: AsyncIterator[str], slot: threading.BoundedSemaphore) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        slot.release()


# -- serving ----------------------------------------------------------------------------------------
class ApiServer:
    """The API served by uvicorn on a thread (the app process, tests); `url` ends in /v1."""

    def __init__(self, root: str | Path, host: str = "127.0.0.1", port: int = 0, max_in_flight: int = MAX_IN_FLIGHT):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: without, each streamed piece waits ~40 ms on the
        # client's delayed ACK (uvicorn sets it only on the sockets it binds itself)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{self.port}/v1"
        self.app = create_app(root, max_in_flight)
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="openai-api", daemon=True)

    def start(self) -> "ApiServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.app.state.runs.close()
        self._sock.close()


def main(argv: list[str] | None = None) -> int:
    """`./launch.sh serve [--runs DIR] [--host H] [--port P]`: the API over the runs in DIR."""
    parser = argparse.ArgumentParser(prog="./launch.sh serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="runs", help="the output folder whose runs are served (default: runs)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: loopback only; anything else exposes the runs)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    root = Path(args.runs).resolve()
    root.mkdir(parents=True, exist_ok=True)
    key_of(root)
    key_of(root, VIEWER_KEY_FILE)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {args.host}, not loopback only: anyone who reaches port {args.port} "
              "and holds a key can use the runs' models", file=sys.stderr, flush=True)
    print(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1 for the runs in {root}\n"
          f"key for every run: {root / KEY_FILE} (a viewer's: {root / VIEWER_KEY_FILE}); each run's own: "
          f"<run>/{KEY_FILE} and <run>/{VIEWER_KEY_FILE}", flush=True)
    uvicorn.run(create_app(root), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
