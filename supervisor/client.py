"""The one Python client of a running run: every front end (Gradio, notebook, scripts) uses it.

    client = RunClient.connect("runs/my-run")
    for piece in client.generate("reverse: hello\\n", max_new_tokens=16):
        print(piece, end="")                   # streamed as the live weights produce it
    client.pause(); client.set(lr=1e-4); client.resume()
    for event in client.events(from_line=0):  # history from events.jsonl, then the live stream
        ...

Commands are contract.protocol's pydantic models: each method builds one (so its defaults, e.g.
`stop(save=True)`, and its validation are the contract's, and a bad argument is refused here
with the server's message), `send(command)` sends one already built.

It speaks contract.protocol (newline-delimited JSON, the run's token from control.json) over one
connection for commands and one per `events()` stream. Which key: `role=Role.OPERATOR` reads
control.json, `role=Role.VIEWER` viewer.json (the run then refuses every command that changes it,
contract.protocol.roles), `address=PATH` a copy of either handed to you; the default is the
operator's key when this user may read control.json, else the viewer's. A lost connection is reopened on the next
call; an events stream resumes at the line after the last one it yielded, so a reconnect loses
no event and repeats none. When the run has ended, `events()` yields the rest of events.jsonl
and stops. Torch-free, like the rest of app/.
"""

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
from typing import Any, Callable, Iterator, Protocol, TypeVar

from contract.events import run_state
from contract.protocol.data_commands import AddSource, Forget, Inbox, RemoveSource, SetWeight, SourceFormat, Teach
from contract.protocol.branch_commands import Branch, Branches, Rewind, Snapshot
from contract.protocol.base import Command, ProtocolError
from contract.protocol.commands import Evaluate, Generate, Pause, Resume, Save, Set, Status, Stop, Subscribe, command_from_wire
from contract.protocol.roles import Role
from contract.protocol.states import RunState
from contract.protocol.wire import encode
from contract.run_folder import RunFolder, read_events

TERMINAL_STATES = tuple(s.value for s in RunState if s.final)


class Answers(Protocol):
    """Where the messages answering one request go (a queue.Queue, or an event loop's hand-over)."""

    def put(self, message: dict) -> None: ...


class CommandError(RuntimeError):
    """The run refused a command or it failed; nothing was changed by it."""


class RunGone(ConnectionError):
    """The run's control server is not there (the run ended, or never started)."""


class Chunk(str):
    """A piece of streamed text; `model` is "current" (the weights being trained) or "base"
    (the same request answered with the PEFT adapter disabled)."""

    model: str

    def __new__(cls, text: str, model: str = "current") -> "Chunk":
        chunk = super().__new__(cls, text)
        chunk.model = model
        return chunk


class Generation:
    """A streamed answer: iterate for its chunks; afterwards `result` holds the run's reply
    (`text`, `step` the training step it was answered at, `base` with compare_base)."""

    def __init__(self, answers: "queue.Queue[dict]", timeout: float | None):
        self._answers, self._timeout = answers, timeout
        self.result: dict | None = None

    def __iter__(self) -> Iterator[Chunk]:
        while self.result is None:
            message = _next_answer(self._answers, self._timeout)
            kind = message["type"]
            if kind == "token":
                yield Chunk(message["text"], message.get("model", "current"))
            elif kind == "done":
                self.result = message["result"]
            elif kind == "error":
                raise CommandError(message["message"])

    def wait(self) -> dict:
        for _ in self:
            pass
        assert self.result is not None  # the loop ends only with a result (or raises)
        return self.result

    @property
    def text(self) -> str:
        return self.wait()["text"]

    @property
    def base_text(self) -> str | None:
        return self.wait().get("base")

    @property
    def step(self) -> int:
        return self.wait()["step"]


def _next_answer(answers: "queue.Queue[dict]", timeout: float | None) -> dict:
    try:
        return answers.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"no answer from the run within {timeout} s") from None


class RunClient:
    """Drive one run. Thread-safe: several threads may send commands at the same time."""

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

    @classmethod
    def connect(cls, run_dir: str | Path, timeout: float = 60.0, role: Role | None = None,
                address: str | Path | None = None) -> "RunClient":
        """Connect to the run in `run_dir`, waiting up to `timeout` s for its server to start;
        `role` / `address`: which key (see the module's docstring)."""
        client = cls(run_dir, connect_timeout=timeout, role=role, address=address)
        with client._lock:
            client._ensure_connected()
        return client

    # -- commands ----------------------------------------------------------------------------------
    def command(self, cmd: str, timeout: float | None = None, **args: Any) -> dict:
        """Send the command named `cmd` with wire arguments `args` and wait for its result (it
        takes effect at the next step boundary)."""
        return self.send(_build(lambda: command_from_wire(cmd, args)), timeout)

    def send(self, command: Command, timeout: float | None = None) -> dict:
        """Send a contract.protocol command and wait for its result. A status read whose
        connection the server closed as it was sent (an idle connection's close crossing the
        request) is asked once more on a fresh one: it changes nothing; a command with an effect
        is never sent twice."""
        for attempt in (1, 2):
            answers = self._request(command)
            while True:
                message = _next_answer(answers, timeout)
                if message["type"] == "done":
                    return message["result"]
                if message["type"] == "error":
                    if message.get("lost") and attempt == 1 and isinstance(command, Status):
                        break
                    raise CommandError(message["message"])
        raise AssertionError("unreachable: the second try returns or raises")

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 timeout: float | None = None, **params: Any) -> Generation:
        """Stream an answer of the live weights to `prompt` or to chat `messages` (the model's
        chat template); params: max_new_tokens, temperature, top_p, top_k, repetition_penalty,
        stop, seed, compare_base."""
        args = dict(params)
        if prompt is not None:
            args["prompt"] = prompt
        if messages is not None:
            args["messages"] = messages
        command = _build(lambda: Generate(**args))
        return Generation(self._request(command), timeout)

    def stream(self, command: Command, timeout: float | None = None) -> Generation:
        """Send a command whose answer streams (`generate`, `complete`): its pieces, then `result`."""
        return Generation(self._request(command), timeout)

    def submit(self, command: Command, answers: Answers) -> None:
        """Send `command`; every message of its answer (`token`, then `done` or `error`) is handed
        to `answers.put` from this client's reader thread (an event loop's front end passes one
        that moves it onto the loop: no thread of its own waits for the run)."""
        self._request(command, answers)

    @property
    def connected(self) -> bool:
        """Whether the connection to the run is open now (sending then never waits to connect)."""
        return self._sock is not None

    def chat(self, prompt: str | None = None, *, messages: list[dict] | None = None, **params: Any) -> str:
        """The whole answer at once."""
        return self.generate(prompt, messages=messages, **params).text

    def pause(self) -> dict:
        return self.send(Pause())

    def resume(self) -> dict:
        return self.send(Resume())

    def stop(self, save: bool = Stop().save) -> dict:
        """Stop at the next boundary; `save` (contract.protocol.commands.Stop's default, true): a
        checkpoint now and the final model at the end."""
        return self.send(_build(lambda: Stop(save=save)))

    def save(self) -> dict:
        return self.send(Save())

    def evaluate(self) -> dict:
        return self.send(Evaluate())

    def set(self, **changes: Any) -> dict:
        """Live settings: lr, lr_scale, grad_clip, eval_every_n_steps, save_every_n_steps,
        generation (a dict of generation defaults)."""
        return self.send(_build(lambda: Set(**changes)))

    def rewind(self, target: str | int) -> dict:
        """Go back in place to a checkpoint ("step-40", 40) or snapshot (its name); the steps
        after it are abandoned. Returns the `rewind` event's fields."""
        return self.send(_build(lambda: Rewind(target=str(target))))

    def branch(self, target: str | int, name: str, **settings: Any) -> dict:
        """Rewind to `target` and go on as the new branch `name`, optionally with changed
        settings (lr, lr_scale, grad_clip, eval_every_n_steps, save_every_n_steps)."""
        return self.send(_build(lambda: Branch(target=str(target), branch=name, **settings)))

    def snapshot(self, name: str | None = None) -> dict:
        """Keep the training state in host memory (for an instant rewind); its size and the
        snapshots kept."""
        return self.send(_build(lambda: Snapshot(snapshot=name)))

    def branches(self) -> dict:
        """The branch tree, the present branch, the checkpoints and snapshots one can go back to."""
        return self.send(Branches())

    # -- data: sources and the inbox of taught answers -------------------------------------
    def add_source(self, path: str, weight: float = AddSource.model_fields["weight"].default,
                   format: SourceFormat = AddSource.model_fields["format"].default,
                   name: str = "") -> dict:
        """Add a training source from the next step on (read and checked like data at start: the
        reply's `report` names dropped rows; an unusable file is refused). Returns the source and
        all `sources`."""
        return self.send(_build(lambda: AddSource(path=str(path), weight=weight, format=format, source=name)))

    def set_weight(self, name: str, weight: float) -> dict:
        """Change a source's weight from the next step on; 0 pauses it."""
        return self.send(_build(lambda: SetWeight(source=name, weight=weight)))

    def remove_source(self, name: str) -> dict:
        """Stop drawing from a source from the next step on."""
        return self.send(_build(lambda: RemoveSource(source=name)))

    def teach(self, prompt: str | None, answer: str, *, messages: list[dict] | None = None,
              **rate: Any) -> dict:
        """Teach `answer` for `prompt` (as given to generate) or chat `messages`: appended to the
        run's inbox durably, then mixed into the next batches. rate: per_step, steps,
        check_after, weight (defaults: the run's teach.* settings). Returns the entry's `id`
        and the model's greedy answer before (`old`)."""
        args: dict[str, Any] = {"answer": answer, **rate}
        if messages is not None:
            args["messages"] = messages
        else:
            args["prompt"] = prompt
        return self.send(_build(lambda: Teach(**args)))

    def prefer(self, prompt: str | None, chosen: str, rejected: str, *, messages: list[dict] | None = None,
               **rate: Any) -> dict:
        """A preference from the chat: for `prompt` (as given to generate) or chat `messages`,
        `chosen` is the better answer and `rejected` the worse (say the model's own answer, edited
        into `chosen`). Into the inbox durably, as teach; the run trains on the pair from the next
        step with its objective (kto: two judged answers; sft: the chosen answer plus the pair
        loss of preference.sft_pairs). rate as for teach."""
        return self.teach(prompt, chosen, messages=messages, rejected=rejected, **rate)

    def inbox(self) -> dict:
        """The inbox: `entries` ({id, prompt, answer, removed, steps_left, and a preference's
        rejected}) and the `sources`."""
        return self.send(Inbox())

    def forget(self, entry_id: str) -> dict:
        """Stop training on inbox entry `entry_id` from the next step on."""
        return self.send(_build(lambda: Forget(id=entry_id)))

    def status(self, ranks: bool = False) -> dict:
        """Step, epoch, state, last metrics, queue length and memory (rank 0's at once; with
        `ranks`, every rank's, gathered at the next boundary)."""
        return self.send(_build(lambda: Status(ranks=ranks)))

    # -- events -------------------------------------------------------------------------------------
    def events(self, from_line: int = 0, follow: bool = True,
               reconnect_timeout: float | None = None) -> Iterator[dict]:
        """Every event from line `from_line` of events.jsonl on, each with its `line` number;
        with `follow`, then the live stream until the run ends. A dropped connection is reopened
        (for up to `reconnect_timeout` s; None: while the run's processes live)."""
        next_line = from_line
        while follow:
            try:
                sock = self._open(reconnect_timeout)
            except RunGone:
                break
            try:
                sock.sendall(encode(self._message(Subscribe(from_line=next_line))))
                for message in _lines(sock):
                    if message.get("type") == "event" and message["line"] >= next_line:
                        next_line = message["line"] + 1
                        yield {**message["event"], "line": message["line"]}
                    elif message.get("type") == "error":
                        raise CommandError(message["message"])
            except OSError:
                pass  # reconnect and go on from next_line
            finally:
                sock.close()
        for n, event in enumerate(read_events(self.folder.events, next_line), start=next_line):
            yield {**event, "line": n}

    # -- plumbing -----------------------------------------------------------------------------------
    def _message(self, command: Command) -> dict:
        return {"token": self._address()["token"], "id": f"{self._prefix}-{next(self._ids)}",
                **command.to_wire()}

    def _request(self, command: Command, answers: Answers | None = None) -> "queue.Queue[dict]":
        """Send `command`; its answer's messages go to `answers`, else to a new queue (returned)."""
        mine: queue.Queue[dict] = queue.Queue()
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
            for message in _lines(sock):
                req_id = str(message.get("id"))
                with self._lock:
                    waiting = self._waiting.get(req_id)
                    if message.get("type") in ("done", "error"):
                        self._waiting.pop(req_id, None)
                if waiting is not None:
                    waiting[1].put(message)
        except (OSError, ValueError):
            pass
        with self._lock:  # every request sent on this connection learns its answer will not come
            if self._sock is sock:
                self._sock = None
            ids = [k for k, (s, _) in self._waiting.items() if s is sock]
            lost = [self._waiting.pop(k)[1] for k in ids]
        for answers in lost:
            answers.put({"type": "error", "lost": True,
                         "message": "the connection to the run was lost before the answer came"})

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
            raise RunGone(f"no control server for {self.folder.root} ({self._run_state()})") from None
        except PermissionError:
            hint = "; a viewer connects with role=Role.VIEWER (viewer.json)" if path == self.folder.control else ""
            raise CommandError(f"cannot read {path}: permission denied{hint}") from None

    def _open(self, timeout: float | None) -> socket.socket:
        """A new connection to the run's server, retrying while the run may still come: until
        `timeout`, or with None for as long as its launcher or its server process lives."""
        deadline = None if timeout is None else time.monotonic() + timeout
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
            if (deadline is not None and time.monotonic() >= deadline) or \
                    not self._may_come_back(unknown=deadline is not None):
                raise RunGone(f"{problem} (run state: {self._run_state()})")
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
        return unknown and not traces and self._run_state() not in TERMINAL_STATES

    def _run_state(self) -> str:
        state = run_state(read_events(self.folder.events))
        return "not started" if state is None else state.value

    def close(self) -> None:
        with self._lock:
            self._drop_connection()

    def __enter__(self) -> "RunClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


C = TypeVar("C", bound=Command)


def _build(make: Callable[[], C]) -> C:
    """`make()`'s command; a bad argument is refused like the run would refuse it."""
    try:
        return make()
    except ProtocolError as e:
        raise CommandError(str(e)) from None


def _lines(sock: socket.socket) -> Iterator[dict]:
    """The JSON messages arriving on `sock`, until the server ends the connection."""
    sock.settimeout(None)
    reader = sock.makefile("rb")
    try:
        for raw in reader:
            if raw.strip():
                yield json.loads(raw)
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
