"""Folders on disk or in an object store: checked, marked complete, moved into place, removed.

The file-system half of an atomic save (engine.checkpoint.atomic decides when, after the ranks
agree): the completion marker written in one step, the temporary folder renamed over its
target (an older folder moved aside first), the `latest` pointer, and deletion that unmarks a
folder before removing it, so a half-deleted folder is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zipfile
from pathlib import Path

from engine.checkpoint.locations import MARKER, OLD_PREFIX, POINTER, TMP_PREFIX, Location
from engine.checkpoint.reading import list_checkpoints


def cut_short(root: Path, relpaths: list[str]) -> list[str]:
    """Files that are not whole: missing, or a zip archive (torch.save's format) without its
    central directory, which is written last."""
    cut = []
    for rel in relpaths:
        path = root / rel
        if not path.is_file():
            cut.append(f"{rel} (missing)")
            continue
        with open(path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"
        if is_zip and not zipfile.is_zipfile(path):
            cut.append(f"{rel} (a zip archive without its end)")
    return cut


def sizes_differ(local: Path, manifest: dict[str, dict]) -> list[str]:
    return [rel for rel, f in manifest.items()
            if not (local / rel).is_file() or (local / rel).stat().st_size != f["size"]]


def newest_complete(target: Location, kind: str) -> str | None:
    try:
        found = list_checkpoints(target.parent.url, kind)
    except Exception:  # noqa: BLE001 - only for the message
        return None
    return found[-1]["name"] if found else None


def upload(local: Path, relpaths: list[str], tmp: Location) -> None:
    for rel in relpaths:
        dest = tmp.child(*rel.split("/"))
        tmp.fs.makedirs(dest.parent.path, exist_ok=True)
        tmp.fs.put_file(str(local / rel), dest.path)


def write_marker(folder: Location, marker: dict) -> None:
    data = json.dumps(marker, indent=1).encode()
    path = folder.child(MARKER)
    if folder.is_local:
        write_local_atomically(Path(path.path), data)
    else:
        folder.fs.pipe_file(path.path, data)


def write_local_atomically(path: Path, data: bytes) -> None:
    """Write a small file in full or not at all (temp + rename). No fsync: on ext4 it would
    force the whole checkpoint just written out to disk before returning (see the module doc)."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def publish(tmp: Location, target: Location) -> None:
    """Move the finished temporary folder to its name; an older folder there is replaced."""
    fs = target.fs
    old = None
    if target.exists():
        old = target.parent.child(f"{OLD_PREFIX}{target.name}-{uuid.uuid4().hex[:8]}")
        if target.is_local:
            os.rename(target.path, old.path)
        else:  # no atomic rename: unmark the old folder first, so it is never taken as complete
            if fs.exists(target.child(MARKER).path):
                fs.rm(target.child(MARKER).path)
            fs.mv(target.path, old.path, recursive=True)
    try:
        if target.is_local:
            os.rename(tmp.path, target.path)
        else:
            fs.mv(tmp.path, target.path, recursive=True)
    except Exception:
        if old is not None and target.is_local:  # the replaced folder back, or the next save deletes it
            os.rename(old.path, target.path)
        raise
    if old is not None:
        flush_before_deleting(target)
        remove(old)


def write_pointer(collection: Location, name: str) -> None:
    """Point `<collection>/latest` at the checkpoint `name` (written in one step)."""
    path = collection.child(POINTER)
    if collection.is_local:
        write_local_atomically(Path(path.path), (name + "\n").encode())
    else:
        collection.fs.pipe_file(path.path, (name + "\n").encode())


def flush_before_deleting(collection: Location) -> None:
    """Put what was written on this machine on the disk before older checkpoints are deleted:
    saves do not fsync (module doc), so without this a power loss just after pruning could
    leave neither the new checkpoint nor the ones it replaced. Object stores need nothing."""
    if collection.is_local:
        os.sync()


def remove(folder: Location) -> None:
    """Delete a folder; an unmarked folder is never mistaken for a checkpoint while it goes."""
    if not folder.exists():
        return
    marker = folder.child(MARKER)
    if folder.fs.exists(marker.path):
        folder.fs.rm(marker.path)
    if folder.is_local:
        shutil.rmtree(folder.path, ignore_errors=True)
    else:
        folder.fs.rm(folder.path, recursive=True)


def remove_stale(collection: Location) -> None:
    """Temporary and replaced folders left by saves that were killed: never complete, deleted."""
    if not collection.exists():
        collection.fs.makedirs(collection.path, exist_ok=True)
        return
    for info in collection.fs.ls(collection.path, detail=True):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info["type"] == "directory" and name.startswith((TMP_PREFIX, OLD_PREFIX)):
            remove(Location(collection.fs, info["name"]))
