"""The command/event protocol between front ends and rank 0. Torch-free; both sides import it.

Wire format: newline-delimited JSON over TCP on the run's control address; never pickle.

Client -> server, one object per line:
    {"token": "<run token>", "id": "<client-chosen id>", "cmd": "<command>", "args": {...}}
    {"token": ..., "id": ..., "cmd": "subscribe", "args": {"from_line": N}}   # events stream

Server -> client, one object per line, each tagged with the request id it belongs to:
    {"type": "ack",   "id": ..., "queued": <queue length>}      accepted, waits for a step boundary
    {"type": "token", "id": ..., "text": "...", "model": "current" | "base"}   streamed generation
    {"type": "done",  "id": ..., "result": {...}}               the command has taken effect
    {"type": "error", "id": ..., "message": "..."}              refused or failed; nothing changed
    {"type": "event", "line": N, "event": {...}}                an events.jsonl record (subscribers)

Commands are applied in order at the next step boundary, by every rank. `status` is answered at
once by rank 0 (rank 0's memory only); `status` with `ranks: true` waits for the boundary and
gathers every rank's memory. `subscribe` streams events.jsonl from line `from_line` (0-based),
then every new line as it is written: no gap, no duplicate.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from typing import Any

MAX_MESSAGE_BYTES = 1 << 20  # a longer line is refused, never buffered without bound
MAX_NEW_TOKENS = 4096

# the generation parameters a request (or the `set generation` defaults) may give
GENERATION_PARAMS: dict[str, type | tuple[type, ...]] = {
    "max_new_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int,
    "repetition_penalty": (int, float), "stop": list, "seed": int}

# command -> the arguments it accepts (name -> type), checked before a command is queued
COMMANDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "generate": {"prompt": str, "messages": list, **GENERATION_PARAMS, "compare_base": bool},
    "pause": {},
    "resume": {},
    "stop": {"save": bool},
    "save": {},
    "evaluate": {},
    "set": {"lr": (int, float), "lr_scale": (int, float), "grad_clip": (int, float),
            "eval_every_n_steps": int, "save_every_n_steps": int, "generation": dict},
    "status": {"ranks": bool},
}

# commands answered by rank 0 at once, without waiting for a step boundary
IMMEDIATE = {"status", "subscribe"}

class RunState(str, Enum):
    """A run's state, as written in `state` events; the one definition every part uses."""
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        """The run is over; nothing can be asked of it any more."""
        return self in (RunState.FINISHED, RunState.FAILED)

    @property
    def live(self) -> bool:
        return not self.final


STATES = tuple(s.value for s in RunState)

# The commands a front end may send in each state (status and subscribe are always answered while
# the run is live). `stop` while stopping ends the process group without waiting for the save.
ALLOWED_COMMANDS: dict[RunState, frozenset[str]] = {
    RunState.STARTING: frozenset({"status", "stop"}),
    RunState.RUNNING: frozenset({"generate", "pause", "stop", "save", "evaluate", "set", "status"}),
    RunState.PAUSED: frozenset({"generate", "resume", "stop", "save", "evaluate", "set", "status"}),
    RunState.STOPPING: frozenset({"status", "stop"}),
    RunState.FINISHED: frozenset(),
    RunState.FAILED: frozenset(),
}


def allowed_commands(state: RunState | str) -> frozenset[str]:
    """The commands allowed in `state` (a RunState or its string value)."""
    return ALLOWED_COMMANDS[RunState(state)]

# bounds of numeric arguments: name -> (lowest, highest, whether the lowest is allowed)
_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "max_new_tokens": (1, MAX_NEW_TOKENS, True), "temperature": (0.0, 100.0, True),
    "top_p": (0.0, 1.0, False), "top_k": (0, 1 << 20, True),
    "repetition_penalty": (0.0, 100.0, False), "seed": (0, 2**63 - 1, True),
    "lr": (0.0, 10.0, True), "lr_scale": (0.0, 1e6, False), "grad_clip": (0.0, 1e9, True),
    "eval_every_n_steps": (0, 2**31, True), "save_every_n_steps": (0, 2**31, True),
    "from_line": (0, 2**63 - 1, True)}
_ROLES = ("system", "user", "assistant")


class ProtocolError(ValueError):
    pass


def check_command(msg: Any) -> tuple[str, str, dict]:
    """Validate a decoded client message (token checked elsewhere); returns (id, cmd, args)."""
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    req_id, cmd, args = msg.get("id"), msg.get("cmd"), msg.get("args", {})
    if not isinstance(req_id, (str, int)) or isinstance(req_id, bool):
        raise ProtocolError("field `id` must be a string or integer")
    if not isinstance(args, dict):
        raise ProtocolError("field `args` must be an object")
    if cmd == "subscribe":
        _check_types("subscribe", args, {"from_line": int})
        _check_bounds("subscribe", args)
        return str(req_id), cmd, args
    if not isinstance(cmd, str) or cmd not in COMMANDS:
        raise ProtocolError(f"unknown command {cmd!r}; allowed: {', '.join(sorted(COMMANDS))}, subscribe")
    _check_types(cmd, args, COMMANDS[cmd])
    _check_bounds(cmd, args)
    if cmd == "generate":
        if not (("prompt" in args) ^ ("messages" in args)):
            raise ProtocolError("generate: give exactly one of `prompt` or `messages`")
        if "messages" in args:
            check_messages(args["messages"])
        _check_stop(cmd, args)
    if cmd == "set":
        if not args:
            raise ProtocolError(f"set: name at least one of {', '.join(COMMANDS['set'])}")
        if "generation" in args:
            check_generation_defaults(args["generation"])
    return str(req_id), cmd, args


def check_generation_defaults(values: dict) -> None:
    """The `set generation={...}` defaults: generation parameters only, each of its type."""
    _check_types("set generation", values, GENERATION_PARAMS)
    _check_bounds("set generation", values)
    _check_stop("set generation", values)


def check_messages(messages: list) -> None:
    """A chat: a non-empty list of {"role": system|user|assistant, "content": str}."""
    if not messages:
        raise ProtocolError("generate: `messages` must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or \
                m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise ProtocolError(f"generate: messages[{i}] must be {{\"role\": one of {', '.join(_ROLES)}, "
                                f"\"content\": a string}}")


def _check_types(cmd: str, args: dict, allowed: dict) -> None:
    for key, value in args.items():
        if key not in allowed:
            raise ProtocolError(f"{cmd}: unknown argument {key!r}; allowed: {', '.join(allowed) or 'none'}")
        if not isinstance(value, allowed[key]) or isinstance(value, bool) and allowed[key] is not bool:
            raise ProtocolError(f"{cmd}: argument {key!r} has the wrong type ({type(value).__name__})")


def _check_bounds(cmd: str, args: dict) -> None:
    for key, value in args.items():
        if key not in _BOUNDS or isinstance(value, bool):
            continue
        lo, hi, lo_ok = _BOUNDS[key]
        if not math.isfinite(value) or value > hi or value < lo or (value == lo and not lo_ok):
            low = f">= {lo}" if lo_ok else f"> {lo}"
            raise ProtocolError(f"{cmd}: argument {key!r} must be {low} and <= {hi}, got {value}")


def _check_stop(cmd: str, args: dict) -> None:
    stop = args.get("stop")
    if stop is not None and not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError(f"{cmd}: argument 'stop' must be a list of non-empty strings")


def encode(obj: dict) -> bytes:
    return (json.dumps(obj, default=_plain) + "\n").encode()


def _plain(value: Any) -> Any:
    """Numbers from numpy / torch as plain numbers, anything else JSON cannot hold as text."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def decode(line: bytes) -> Any:
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message larger than {MAX_MESSAGE_BYTES} bytes")
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed JSON: {e}") from None
