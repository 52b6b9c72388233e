"""Reading checkpoints back: the completion marker, the complete checkpoints of a folder, which one
`latest` or `resume=` means, and whether the files still match their manifest. Every failure is
its own CheckpointError with a message that says what is wrong."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from engine.checkpoint.locations import (FORMAT, MARKER, OLD_PREFIX, POINTER, TMP_PREFIX, CheckpointNotFoundError,
                                         CorruptCheckpointError, IncompleteCheckpointError, Location, WrongKindError,
                                         file_digest, location)

# -- reading --------------------------------------------------------------------------------------
def read_marker(folder: Location) -> dict | None:
    """The completion marker of a folder, or None when it has none (never finished)."""
    path = folder.child(MARKER)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path.url} is not valid JSON ({e}); the checkpoint "
                                     f"cannot be trusted") from None


def complete_marker(url: str, kind: str | None = None) -> dict:
    """The marker of a complete folder of `kind`, or a clear error saying what is wrong."""
    folder = location(url)
    if not folder.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {folder.url}: the folder does not exist")
    marker = read_marker(folder)
    if marker is None:
        nearby = [c["name"] for c in list_checkpoints(folder.parent.url)]
        raise IncompleteCheckpointError(
            f"{folder.url} has no completion marker ({MARKER}): the save that wrote it did not "
            f"finish, so it is not used. Complete checkpoints beside it: {nearby or 'none'}")
    if marker.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{folder.url}/{MARKER} has format {marker.get('format')!r}, "
                                     f"expected {FORMAT!r}")
    if kind is not None and marker.get("kind") != kind:
        raise WrongKindError(f"{folder.url} is a {marker.get('kind')} folder, not a {kind} one"
                             + (" (load it with load_model / load_peft)" if kind == "training" else ""))
    return marker


def list_checkpoints(collection_url: str, kind: str = "training") -> list[dict]:
    """The complete checkpoints directly under a folder, oldest step first; each is its marker
    plus "name" and "url". Temporary and unmarked folders are left out."""
    collection = location(collection_url)
    if not collection.exists():
        return []
    found = []
    for info in collection.fs.ls(collection.path, detail=True):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info["type"] != "directory" or name.startswith((TMP_PREFIX, OLD_PREFIX)):
            continue
        folder = Location(collection.fs, info["name"])
        try:
            marker = read_marker(folder)
        except CorruptCheckpointError:
            continue
        if marker and marker.get("format") == FORMAT and marker.get("kind") == kind:
            found.append({**marker, "name": name, "url": folder.url})
    return sorted(found, key=lambda m: (m.get("step", 0), m.get("created", 0)))


def latest_checkpoint(collection_url: str) -> str | None:
    """The checkpoint `latest` names when it is complete, else the newest complete one."""
    collection = location(collection_url)
    pointer = collection.child(POINTER)
    if pointer.exists():
        name = pointer.read_text().strip()
        candidate = collection.child(name)
        marker = read_marker(candidate) if name and candidate.exists() else None
        if marker is not None and marker.get("kind") == "training":
            return candidate.url
    complete = list_checkpoints(collection.url)
    return complete[-1]["url"] if complete else None


def resolve_checkpoint(value: str, checkpoints_url: str) -> str:
    """The training checkpoint to continue from: `value` is a checkpoint folder, a folder of
    checkpoints (the one its `latest` names), or "latest" (in the run's `checkpoints_url`)."""
    collection = None
    if value == "latest":
        collection = location(checkpoints_url)
    else:
        folder = location(value)
        if not folder.exists():
            raise CheckpointNotFoundError(f"resume={value}: no such checkpoint folder")
        if read_marker(folder) is not None:
            complete_marker(folder.url, "training")  # the right kind, or a clear error
            return folder.url
        if not folder.child(POINTER).exists() and not list_checkpoints(folder.url):
            complete_marker(folder.url, "training")  # raises: an unfinished checkpoint
        collection = folder
    found = latest_checkpoint(collection.url)
    if found is None:
        ignored = [n for n in _subfolders(collection) if not n.startswith(OLD_PREFIX)]
        raise CheckpointNotFoundError(f"resume={value}: no complete checkpoint in {collection.url}"
                                      + (f" (unfinished, ignored: {ignored})" if ignored else ""))
    return found


def _subfolders(collection: Location) -> list[str]:
    if not collection.exists():
        return []
    return sorted(i["name"].rstrip("/").rsplit("/", 1)[-1]
                  for i in collection.fs.ls(collection.path, detail=True) if i["type"] == "directory")


def verify(folder: Location, marker: dict, relpaths: list[str] | None = None,
           local_root: Path | None = None) -> list[str]:
    """Problems of the listed files (all of the manifest when None): missing, wrong size, wrong
    hash. `local_root`: a local copy to hash (the folder itself when it is local)."""
    files = marker.get("files", {})
    root = local_root if local_root is not None else (Path(folder.path) if folder.is_local else None)
    problems = []
    for rel in files if relpaths is None else relpaths:
        expected = files[rel]
        path = root / rel if root is not None else None
        if path is None or not path.is_file():
            problems.append(f"missing {rel}")
        elif path.stat().st_size != expected["size"]:
            problems.append(f"{rel} has {path.stat().st_size} bytes, the manifest says {expected['size']}")
        elif file_digest(path) != expected["xxh3"]:
            problems.append(f"{rel} does not match its hash (the file changed or is damaged)")
    return problems


def missing_files(folder: Location, marker: dict) -> list[str]:
    """Files the manifest lists that the folder lacks (one listing, no reads)."""
    present = set()
    base = folder.path.rstrip("/") + "/"
    for path in folder.fs.find(folder.path):
        present.add(path[len(base):] if path.startswith(base) else path)
    return [rel for rel in marker.get("files", {}) if rel not in present]


def fetch(folder: Location, relpaths: list[str]) -> tuple[Path, bool]:
    """A local folder holding `relpaths` of `folder`: the folder itself when local, else a
    temporary download (the bool says whether the caller must delete it)."""
    if folder.is_local:
        return Path(folder.path), False
    local = Path(tempfile.mkdtemp(prefix="livetune-fetch-"))
    for rel in relpaths:
        dest = local / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        folder.fs.get_file(folder.child(*rel.split("/")).path, str(dest))
    return local, True
