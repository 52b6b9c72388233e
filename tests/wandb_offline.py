"""Reading what `wandb` wrote offline (`<dir>/wandb/offline-run-*/run-*.wandb`), for tests.

The file is LevelDB's log format (a 7-byte `:W&B` header, then 32 KiB blocks of records, each
with a 7-byte header: crc32c, length, type FULL/FIRST/MIDDLE/LAST) holding W&B's own protobuf
`Record` messages, parsed here with the wandb package's generated classes. wandb 0.31 no longer
ships a Python reader (its Go core writes the file). Not a test module."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B log"
    out, parts, pos = [], [], HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += left  # zero padding to the end of the block
            continue
        body = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(body)
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE:
            parts.append(body)
        elif kind == LAST:
            out.append(b"".join([*parts, body]))
    return out


def history(run_dir: Path) -> list[dict]:
    """The `history` rows (one per `wandb.log`) of the offline run under `run_dir/wandb/`."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    rows = []
    for raw in records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
