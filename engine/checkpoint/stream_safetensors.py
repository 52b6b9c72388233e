"""A safetensors file written one tensor at a time.

`safetensors.torch.save_file` takes the whole shard as a dict and turns every tensor into bytes
before it writes: the shard is held twice, on top of what gathering it costs under ZeRO-3. The
format is simple and fixed (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes in that order), and every tensor's
dtype and shape is known before it is gathered, so the header is written first and each tensor
is appended as soon as it is gathered, then released. Files are read back with `safetensors`
itself (`safe_open`, `from_pretrained`), which checks the header and the byte ranges.
"""

from __future__ import annotations

import json
import struct
import sys
from typing import Sequence

import torch

# torch dtype -> safetensors' name for it
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}


class StreamedSafetensors:
    """`with StreamedSafetensors(path, [(key, shape, dtype), ...], metadata) as f: f.write(key, t)`
    for every tensor, in the order given."""

    def __init__(self, path: str, layout: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":  # safetensors stores little-endian bytes
            raise RuntimeError("writing safetensors on a big-endian machine is not supported")
        header: dict = {"__metadata__": dict(metadata or {})}
        self._order: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        offset = 0
        for key, shape, dtype in layout:
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"{key}: safetensors cannot store dtype {dtype}")
            size = torch.Size(shape).numel() * dtype.itemsize
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._order.append((key, tuple(shape), dtype))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._next = 0
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Append the next tensor of the layout; its key, shape and dtype must match it."""
        want = self._order[self._next]
        got = (key, tuple(tensor.shape), tensor.dtype)
        if got != want:
            raise ValueError(f"expected tensor {want[0]} {want[1]} {want[2]} next, got {got[0]} {got[1]} {got[2]}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        complete = self._next == len(self._order)
        self._file.close()
        if not complete:  # a partial file must never look like a model (the folder is not published)
            raise RuntimeError(f"{self._file.name}: {len(self._order) - self._next} tensors were not written")

    def __enter__(self) -> "StreamedSafetensors":
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self._file.close()
