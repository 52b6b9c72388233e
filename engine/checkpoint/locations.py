"""Where checkpoints live: folders on any fsspec file system (a local path or a URL), the names
that mark a folder complete or unfinished, the errors every checkpoint operation raises, and the
xxh3 hashes of the files in a manifest. Publishing is engine.checkpoint.atomic; reading back is
engine.checkpoint.reading."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import xxhash

MARKER = "COMPLETE.json"
POINTER = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
FORMAT = "livetune-checkpoint-v1"


# -- errors -------------------------------------------------------------------------------------
class CheckpointError(Exception):
    """A checkpoint cannot be saved or loaded; the message says why and what to do."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    pass


class IncompleteCheckpointError(CheckpointError):
    """The folder has no completion marker: the save that wrote it never finished."""


class MissingFilesError(CheckpointError):
    pass


class CorruptCheckpointError(CheckpointError):
    pass


class LayoutMismatchError(CheckpointError):
    """The checkpoint was written by another parallel layout (or another model / method)."""


class WrongKindError(CheckpointError):
    """A model export where a training checkpoint was expected, or the other way round."""


class DiskFullError(CheckpointError):
    """The file system ran out of space during a save, or would have (`foreseen`)."""

    def __init__(self, message: str, path: str, needed: int | None, free: int | None, foreseen: bool):
        super().__init__(message)
        self.path, self.needed, self.free, self.foreseen = path, needed, free, foreseen

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self):
        return (type(self), (self.args[0], self.path, self.needed, self.free, self.foreseen))


# -- locations ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Location:
    """A folder on some fsspec file system."""
    fs: Any
    path: str

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    @property
    def url(self) -> str:
        return self.path if self.is_local else self.fs.unstrip_protocol(self.path)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> "Location":
        return Location(self.fs, self.path.rstrip("/").rsplit("/", 1)[0] or "/")

    def child(self, *parts: str) -> "Location":
        return Location(self.fs, "/".join([self.path.rstrip("/"), *parts]))

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def read_text(self) -> str:
        return self.fs.cat_file(self.path).decode("utf-8")


def location(url: str | os.PathLike) -> Location:
    """The file system and path of a local path or fsspec URL."""
    fs, path = fsspec.core.url_to_fs(str(url))
    return Location(fs, path)


def _protocols(fs) -> tuple:
    proto = fs.protocol
    return proto if isinstance(proto, tuple) else (proto,)


# -- hashing --------------------------------------------------------------------------------------
def file_digest(path: str | Path) -> str:
    """xxh3-128 of a local file, read through a memory map (no copy into Python memory)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return xxhash.xxh3_128(m).hexdigest()


def describe(root: Path, relpaths: list[str]) -> dict[str, dict]:
    """{relpath: {"size", "xxh3"}} of files under a local folder."""
    return {rel: {"size": (root / rel).stat().st_size, "xxh3": file_digest(root / rel)} for rel in relpaths}


def local_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
