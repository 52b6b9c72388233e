"""A full disk and a failed save, on a small tmpfs mounted by each test (issue 17, "A full disk").

In one process (atomic.writing itself): a save that fills the disk in the middle fails as
DiskFullError naming the folder, the space needed and free, leaves no partial folder and marks
nothing complete; one that cannot fit is refused before it starts, with a warning event; a file
cut short is never marked complete. On 2 real DeepSpeed ranks (slow): a save that fails on one
rank only fails on both, the run trains on and the event names the failure; a scheduled save on
a full disk ends the run with the disk-full message, and the resumed run repeats the losses.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from engine.checkpoint import atomic, space

MiB = 2**20


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "40m") -> Iterator[Path]:
    """A tmpfs of `size` at `path`, unmounted on the way out whatever happened."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk") as disk:
        yield disk


def fill(disk: Path, leave: int) -> Path:
    """A file that leaves about `leave` bytes free on `disk`."""
    filler = disk / "filler"
    size = space.free_bytes(disk) - leave
    with open(filler, "wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(size, 0))  # written, not sparse: tmpfs counts only written pages
    return filler


def save(url: Path, nbytes: int, emit=None) -> str:
    """A one-file checkpoint of about `nbytes` (a torch zip archive, as DeepSpeed writes)."""
    with atomic.writing(str(url), kind="training", meta={"step": int(url.name.split("-")[1])},
                        pointer=True, emit=emit) as w:
        torch.save({"w": torch.ones(nbytes // 4)}, w.local / "model.pt")
    return str(url)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((atomic.TMP_PREFIX, atomic.OLD_PREFIX)))


def test_the_disk_filling_in_the_middle_of_a_save_fails_it_as_a_full_disk(small_disk):
    ckpts = small_disk / "checkpoints"
    save(ckpts / "step-1", 2 * MiB)  # small: the estimate for the next save says it fits
    free_before = space.free_bytes(small_disk)
    events: list[dict] = []
    fill(small_disk, leave=6 * MiB)
    with pytest.raises(atomic.DiskFullError) as caught:
        save(ckpts / "step-2", 12 * MiB, emit=events.append)
    message = str(caught.value)
    assert message.startswith("disk full: saving ") and str(ckpts / "step-2") in message
    assert "needs about 2.0 MiB (the size of step-1)" in message   # needed, from the previous checkpoint
    assert f"{str(ckpts)} had 6.0 MiB free" in message or "MiB free" in message
    assert "step-1, is untouched" in message
    assert caught.value.free is not None and 5 * MiB < caught.value.free <= 6 * MiB + MiB
    assert leftovers(ckpts) == []                                   # the partial folder is gone
    assert not (ckpts / "step-2").exists()
    assert [c["name"] for c in atomic.list_checkpoints(str(ckpts))] == ["step-1"]
    assert atomic.resolve_checkpoint("latest", str(ckpts)) == str(ckpts / "step-1")
    step1 = atomic.location(str(ckpts / "step-1"))
    assert atomic.verify(step1, atomic.complete_marker(step1.url, "training")) == []
    (failed,) = [e for e in events if e["type"] == "checkpoint_failed"]
    assert failed["disk_full"] and not failed["foreseen"] and failed["path"] == str(ckpts / "step-2")
    (small_disk / "filler").unlink()
    assert space.free_bytes(small_disk) == free_before               # nothing of the partial save is left
    save(ckpts / "step-2", 12 * MiB)                                  # room again: it goes through
    assert [c["name"] for c in atomic.list_checkpoints(str(ckpts))] == ["step-1", "step-2"]


def test_a_first_save_that_fills_the_disk_says_how_much_it_wrote(small_disk):
    ckpts = small_disk / "checkpoints"
    fill(small_disk, leave=5 * MiB)
    with pytest.raises(atomic.DiskFullError) as caught:
        save(ckpts / "step-1", 12 * MiB)
    assert "needs more than the" in str(caught.value) and "written before the disk filled" in str(caught.value)
    assert "no complete checkpoint is there yet" in str(caught.value)
    assert leftovers(ckpts) == [] and not (ckpts / "step-1").exists()


def test_a_save_that_cannot_fit_is_refused_before_it_starts_with_a_warning(small_disk):
    ckpts = small_disk / "checkpoints"
    save(ckpts / "step-1", 12 * MiB)
    size = space.manifest_bytes(atomic.complete_marker(str(ckpts / "step-1")))
    fill(small_disk, leave=8 * MiB)
    free = space.free_bytes(small_disk)
    events: list[dict] = []
    with pytest.raises(atomic.DiskFullError) as caught:
        save(ckpts / "step-2", 12 * MiB, emit=events.append)
    assert caught.value.foreseen and caught.value.needed == size and caught.value.free == free
    assert f"needs about {space.mb(size)} (the size of step-1)" in str(caught.value)
    assert f"has {space.mb(free)} free, so the save was not started" in str(caught.value)
    warning, failed = events
    assert warning["type"] == "warning" and warning["needed_bytes"] == size and warning["free_bytes"] == free
    assert failed["type"] == "checkpoint_failed" and failed["foreseen"]
    assert space.free_bytes(small_disk) == free and leftovers(ckpts) == []  # nothing was written


def test_a_file_cut_short_is_never_marked_complete(tmp_path):
    target = tmp_path / "checkpoints" / "step-1"
    with pytest.raises(atomic.CheckpointError, match=r"model.pt \(a zip archive without its end\)"):
        with atomic.writing(str(target), kind="training", meta={"step": 1}) as w:
            torch.save({"w": torch.ones(1000)}, w.local / "model.pt")
            with open(w.local / "model.pt", "r+b") as f:  # a write that lost its tail unnoticed
                f.truncate(os.path.getsize(w.local / "model.pt") - 100)
    assert not target.exists() and leftovers(target.parent) == []


def test_a_deferred_write_failure_is_raised_once_every_rank_is_through(tmp_path):
    class Writer:
        calls = 0

        def save(self, path):
            self.calls += 1
            raise PermissionError(13, "Permission denied", path)

    writer = Writer()
    target = tmp_path / "checkpoints" / "step-1"
    with pytest.raises(atomic.CheckpointError, match="PermissionError: .*Permission denied") as caught:
        with atomic.writing(str(target), kind="training", meta={"step": 1}) as w:
            with w.deferring(writer, "save"):
                assert writer.save("a") is None  # noted, not raised: the body goes on
                writer.save("b")                  # after a failure nothing more is written
            assert "save" not in vars(writer)     # the method is the class's again
    assert writer.calls == 1 and not isinstance(caught.value, atomic.DiskFullError)
    assert not target.exists() and leftovers(target.parent) == []
