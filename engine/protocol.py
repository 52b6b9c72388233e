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

Commands are applied in order at the next step boundary, by every rank.
"""

from __future__ import annotations

import json
from typing import Any

MAX_MESSAGE_BYTES = 1 << 20  # a longer line is refused, never buffered without bound

# command -> the arguments it accepts (name -> type), checked before a command is queued
COMMANDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "generate": {"prompt": str, "messages": list, "max_new_tokens": int, "temperature": (int, float),
                 "top_p": (int, float), "top_k": int, "repetition_penalty": (int, float),
                 "stop": list, "seed": int, "compare_base": bool},
    "pause": {},
    "resume": {},
    "stop": {"save": bool},
    "save": {},
    "evaluate": {},
    "set": {"lr": (int, float), "lr_scale": (int, float), "grad_clip": (int, float),
            "eval_every_n_steps": int, "save_every_n_steps": int, "generation": dict},
    "status": {},
}

# commands answered by rank 0 at once, without waiting for a step boundary
IMMEDIATE = {"status", "subscribe"}

# run states, as written in `state` events
STATES = ("starting", "running", "paused", "stopping", "finished", "failed")


class ProtocolError(ValueError):
    pass


def check_command(msg: Any) -> tuple[str, str, dict]:
    """Validate a decoded client message (token checked elsewhere); returns (id, cmd, args)."""
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    req_id, cmd, args = msg.get("id"), msg.get("cmd"), msg.get("args", {})
    if not isinstance(req_id, (str, int)):
        raise ProtocolError("field `id` must be a string or integer")
    if cmd == "subscribe":
        return str(req_id), cmd, args if isinstance(args, dict) else {}
    if cmd not in COMMANDS:
        raise ProtocolError(f"unknown command {cmd!r}; allowed: {', '.join(sorted(COMMANDS))}, subscribe")
    if not isinstance(args, dict):
        raise ProtocolError("field `args` must be an object")
    allowed = COMMANDS[cmd]
    for key, value in args.items():
        if key not in allowed:
            raise ProtocolError(f"{cmd}: unknown argument {key!r}; allowed: {', '.join(allowed) or 'none'}")
        if not isinstance(value, allowed[key]) or isinstance(value, bool) and allowed[key] is not bool:
            raise ProtocolError(f"{cmd}: argument {key!r} has the wrong type ({type(value).__name__})")
    if cmd == "generate" and not (("prompt" in args) ^ ("messages" in args)):
        raise ProtocolError("generate: give exactly one of `prompt` or `messages`")
    return str(req_id), cmd, args


def encode(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def decode(line: bytes) -> Any:
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message larger than {MAX_MESSAGE_BYTES} bytes")
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed JSON: {e}") from None
