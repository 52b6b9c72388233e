"""A run is a folder. This module names its parts and reads/writes its event log.

Torch-free: the app process uses it to list runs, rebuild plots and find the control socket.

    <output_dir>/<run_name>/
        config.yaml        the resolved run config
        events.jsonl       append-only event log (one JSON object per line), the durable record
        control.json       control socket address and token (mode 0600), written by rank 0
        viewer.json        the same with the viewer's token (mode 0600; contract.protocol.roles)
        api_key.json       the OpenAI-compatible API's key of this run (mode 0600, made with the
                           folder; supervisor.openai_api), api_viewer_key.json a viewer's
        logs/              launcher.log and one log per rank (files, never an undrained pipe)
        checkpoints/       training checkpoints; `latest` names the newest complete one
        branches.json      the branch tree, once the run has branched (contract.branches)
        branches/<b>/checkpoints/   each branch's own checkpoints (the root branch's: checkpoints/)
        model/             the final model (Hugging Face format) or adapter (PEFT format)
        tensorboard/       TensorBoard event files
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from datetime import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from contract.branches import ROOT, checkpoints_dir
from contract.events import Event, check_event, parse_event
from contract.protocol.wire import jsonable

if TYPE_CHECKING:
    from contract.config.schema import RunConfig


@dataclass(frozen=True)
class RunFolder:
    root: Path
    branch: str = ROOT  # the branch training writes to: its checkpoints (contract.branches)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def control(self) -> Path:
        return self.root / "control.json"

    @property
    def viewer(self) -> Path:
        """control.json's twin with the viewer token only: what a viewer is given."""
        return self.root / "viewer.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        """The present branch's training checkpoints."""
        return checkpoints_dir(self.root, self.branch)

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def create(self) -> "RunFolder":
        for d in (self.root, self.logs, self.checkpoints):
            d.mkdir(parents=True, exist_ok=True)
        return self


class EventLog:
    """Appends events to events.jsonl (rank 0 only); each line is flushed as it is written."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        # set once the run has branches: every event then names the branch it belongs to
        self.branch: str | None = None

    def emit(self, event: Event | dict[str, Any]) -> dict[str, Any]:
        """Write `event` (a model of contract.events, or a dict checked against its type's model:
        EventError when it does not match) and pass it to the listeners; returns what was written."""
        event = check_event(event)
        event.setdefault("time", time.time())
        if self.branch is not None:
            event.setdefault("branch", self.branch)
        line = json.dumps(event, default=jsonable)
        with self._lock:
            self._file.write(line + "\n")
            listeners = list(self._listeners)
        for listener in listeners:
            listener(event)
        return event

    def subscribe(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener(event)` for every event emitted from now on (the control server)."""
        with self._lock:
            self._listeners.append(listener)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(path: Path, start_line: int = 0) -> Iterator[dict[str, Any]]:
    """Events from line `start_line` on; a partly written last line is left for the next read."""
    yield from EventTail(path, start_line).poll()


def read_models(path: Path, start_line: int = 0) -> list[Event]:
    """read_events' events as their models (EventTail.poll_events)."""
    return EventTail(path, start_line).poll_events()


def write_private_json(path: Path, data: dict) -> None:
    """Write a JSON file only its owner can read (the control token), atomically."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


KEY_FILE = "api_key.json"                # the OpenAI-compatible API's operator key of a folder
VIEWER_KEY_FILE = "api_viewer_key.json"  # and its viewer's key


def key_of(folder: Path, file: str = KEY_FILE) -> str:
    """The API key kept in `folder`'s `file` (made, mode 0600, the first time it is asked for):
    a run folder's open that run, an output folder's every run in it (supervisor.openai_api)."""
    path = Path(folder) / file
    try:
        return str(json.loads(path.read_text())["key"])
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        key = "lt-" + secrets.token_urlsafe(32)
        write_private_json(path, {"key": key})
        return key


READ_CHUNK = 64 * 1024  # what one EventTail.read takes from the file at most (about)


class EventTail:
    """Follows a growing events.jsonl from line `start_line` (0-based) on: each poll returns the
    complete lines written since the last one. The one reader of the event log: front ends
    rebuilding plots, the terminal's progress bar, and the control server feeding subscribers.

    Line numbers are the file's own: a line that is not valid JSON is skipped but still counted,
    so a reader that resumes at a line number gets no gap and no duplicate. A partly written last
    line waits for the next poll."""

    def __init__(self, path: Path, start_line: int = 0):
        self.path, self.start_line = Path(path), start_line
        self.offset = 0  # bytes of the file consumed (complete lines only)
        self.line = 0    # lines consumed, skipped ones included

    def read(self, max_bytes: int | None = READ_CHUNK) -> list[tuple[int, bytes]]:
        """The complete lines written since the last read, as (line number, raw bytes), for
        passing on without parsing (the control server feeds subscribers with them): about
        `max_bytes` of them (at least one whole line; None: all), so that a slow reader's backlog
        stays in the file, not in memory. A line that is not a JSON object keeps its number and is
        skipped. Returns [] only when no complete line is left."""
        while True:
            before = self.offset
            lines = self._read_chunk(max_bytes)
            if lines or self.offset == before:  # something to return, or the end of the file
                return lines

    def _read_chunk(self, max_bytes: int | None) -> list[tuple[int, bytes]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read() if max_bytes is None else f.read(max_bytes)
                while max_bytes is not None and chunk and b"\n" not in chunk:  # one long line
                    more = f.read(max_bytes)
                    if not more:
                        break
                    chunk += more
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1  # leave a partly written last line for the next read
        self.offset += end
        out = []
        for raw in chunk[:end].splitlines():
            n, self.line = self.line, self.line + 1
            raw = raw.strip()
            if n >= self.start_line and raw.startswith(b"{") and raw.endswith(b"}"):
                out.append((n, raw))
        return out

    def _poll_parsed(self) -> list[tuple[int, dict[str, Any], Event]]:
        """The new events as (line number, JSON object, model)."""
        out = []
        for n, raw in self.read(max_bytes=None):
            try:
                event = json.loads(raw)
            except json.JSONDecodeError:  # keep the numbering; a broken line is just not returned
                continue
            model = parse_event(event)
            if model is not None:  # an event that does not match its model is skipped alike
                out.append((n, event, model))
        return out

    def poll_numbered(self) -> list[tuple[int, dict[str, Any]]]:
        """The new events as (line number, event)."""
        return [(n, event) for n, event, _ in self._poll_parsed()]

    def poll(self) -> list[dict[str, Any]]:
        """The new events."""
        return [event for _, event, _ in self._poll_parsed()]

    def poll_events(self) -> list[Event]:
        """The new events as their models: each line is checked against its model as it is read,
        and the folds of the log (supervisor.summary, app.series) take the model as it is rather
        than validate the line a second time."""
        return [model for _, _, model in self._poll_parsed()]


def tail_lines(path: Path, n: int = 20) -> list[str]:
    """The last `n` lines of a (log) file, without reading all of a large one."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            return f.read().decode("utf-8", "replace").splitlines()[-n:]
    except FileNotFoundError:
        return []


# -- a new run's folder ----------------------------------------------------------------------
# Here, not in the supervisor: a run started by a plain script (the engine's composition root)
# makes its folder the same way as one started by a front end.

def make_run_folder(cfg: RunConfig) -> RunFolder:
    """Create the run's folder (unique name) and write its resolved config there."""
    resumed = _run_of_checkpoint(cfg)
    if resumed is not None:  # resume=<run>/checkpoints/<name>: the run goes on in its own folder
        cfg.logging.output_dir = str(resumed.parent)
    name = cfg.logging.run_name or (resumed.name if resumed else datetime.now().strftime("run-%Y%m%d-%H%M%S"))
    root = Path(cfg.logging.output_dir) / name
    if root.exists() and (root / "events.jsonl").exists() and not cfg.resume:
        suffix = 2
        while (Path(cfg.logging.output_dir) / f"{name}-{suffix}").exists():
            suffix += 1
        root = Path(cfg.logging.output_dir) / f"{name}-{suffix}"
    cfg.logging.run_name = root.name
    folder = RunFolder(root.resolve()).create()
    folder.config.write_text(cfg.to_yaml())
    for file in (KEY_FILE, VIEWER_KEY_FILE):  # the API's keys are there from the start
        key_of(folder.root, file)
    return folder


def _run_of_checkpoint(cfg: RunConfig) -> Path | None:
    """The run folder a `resume=` checkpoint path lies in (<run>/checkpoints/<name>, or
    <run>/checkpoints), when no run_name says otherwise and that folder holds a run."""
    value = cfg.resume
    if not value or value == "latest" or cfg.logging.run_name or "://" in value:
        return None
    path = Path(value).resolve()
    if path.name == "checkpoints":
        run = path.parent
    elif path.parent.name == "checkpoints":
        run = path.parent.parent
    else:
        return None
    return run if (run / "events.jsonl").exists() else None
