"""Bytes on the control socket: one JSON object per line, never pickle, never unbounded."""

from __future__ import annotations

import json
from typing import Any

from contract.protocol.base import ProtocolError

MAX_MESSAGE_BYTES = 1 << 20  # a longer line is refused, never buffered without bound


def encode(obj: dict) -> bytes:
    return (json.dumps(obj, default=jsonable) + "\n").encode()


def jsonable(value: Any) -> Any:
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
