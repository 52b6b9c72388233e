"""`held(path)`: an exclusive lock on a file, for work that several processes would otherwise
each do at once (the ranks of a run building the same cache entry or default assets): the first
does it, the others wait, then find it done. The lock is the kernel's (flock): it goes with the
process however it ends, so a killed builder never leaves the others waiting."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the `with` block, and remove the
    file before letting go, so no lock file stays behind. Where no lock can be had (a read-only
    folder, a file system without locks), the block runs unlocked: the callers' work is
    idempotent, a lock only saves doing it twice.

    Callers look again, under the lock, whether the work is done: a process that was waiting
    holds the removed file's lock and finds it done; one arriving after the removal locks a new
    file and finds it done too (or, when the first one failed, does it itself)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+b")
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        handle.close()  # releases the lock
