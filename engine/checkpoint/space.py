"""Disk space for checkpoints: how much a save needs, how much is free, and whether a failed
write means the disk is full.

The space a checkpoint needs is estimated from the newest complete checkpoint of the same kind
beside it (the manifest's sizes): a run's checkpoints are all the same size, give or take a few
bytes of JSON. Only local folders are measured; an object store has no "free space".
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path

# below this much free space after a write error, the error is taken as a full disk: torch's
# zip writer reports a short write as "unexpected pos ..." / "file write failed", without errno
LOW_SPACE = 8 * 2**20
_SHORT_WRITE = ("unexpected pos", "write failed", "PytorchStreamWriter", "inline_container")


@dataclass(frozen=True)
class Space:
    """What a save of one folder needs and what its file system has, measured before the save."""
    free: int | None = None      # bytes free (None: unknown, e.g. an object store)
    needed: int | None = None    # estimated bytes the folder takes (None: nothing to go by)
    basis: str | None = None     # the checkpoint the estimate comes from
    where: str | None = None     # the folder whose file system was measured

    @property
    def short(self) -> bool:
        """The save cannot fit: foreseen before anything is written."""
        return self.free is not None and self.needed is not None and self.free < self.needed


def free_bytes(path: str | Path) -> int:
    """Bytes free to an unprivileged writer on the file system holding `path`."""
    return shutil.disk_usage(path).free


def folder_bytes(path: str | Path) -> int:
    """Bytes of the files under a local folder (0 when it does not exist)."""
    root = Path(path)
    if not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def manifest_bytes(marker: dict) -> int:
    """The size of a complete folder, from its marker's manifest."""
    return sum(int(f.get("size", 0)) for f in marker.get("files", {}).values())


def is_disk_full(error: BaseException, folder: str | Path | None) -> bool:
    """Whether a write error means the file system ran out of space (or quota)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if "No space left" in text or "Disk quota exceeded" in text:
        return True
    if folder is None or not any(s in text for s in _SHORT_WRITE):
        return False
    try:
        return free_bytes(_existing(Path(folder))) < LOW_SPACE
    except OSError:
        return False


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mb(n: int | None) -> str:
    return "an unknown amount" if n is None else f"{n / 2**20:.1f} MiB"
