"""Checkpoint publishing and the keep rules, without DeepSpeed: atomic folders on the local and
the in-memory fsspec file systems, markers, `latest`, resolving `resume=`, integrity checks, and
which folders keep-last / keep-best delete."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest

from engine.checkpoint import atomic
from engine.checkpoint.publish import remove
from engine.checkpoint.locations import CheckpointNotFoundError, IncompleteCheckpointError, WrongKindError
from engine.checkpoint.agreement import Comm
from engine.checkpoint.schedule import SCHEDULE, best_checkpoint, metric_of, to_delete
from engine.checkpoint import locations
from engine.checkpoint import reading


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    """A checkpoints folder on the local file system or in fsspec's memory file system."""
    if request.param == "local":
        yield str(tmp_path / "checkpoints")
        return
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}/checkpoints"
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://").split("/")[0], recursive=True)


def publish(url: str, files: dict[str, bytes], step: int = 1, kind: str = "training",
            pointer: bool = True, **meta) -> None:
    with atomic.writing(url, kind=kind, meta={"step": step, **meta}, pointer=pointer, comm=Comm()) as w:
        for rel, data in files.items():
            (w.local / rel).parent.mkdir(parents=True, exist_ok=True)
            (w.local / rel).write_bytes(data)


def ls(url: str) -> list[str]:
    folder = locations.location(url)
    return sorted(i["name"].rstrip("/").rsplit("/", 1)[-1] for i in folder.fs.ls(folder.path, detail=True))


def test_publish_writes_marker_manifest_and_latest(root):
    publish(f"{root}/step-1", {"a.bin": b"x" * 10, "sub/b.txt": b"hello"}, step=1)
    marker = reading.complete_marker(f"{root}/step-1", "training")
    assert marker["step"] == 1 and set(marker["files"]) == {"a.bin", "sub/b.txt"}
    assert marker["files"]["a.bin"]["size"] == 10
    assert ls(root) == ["latest", "step-1"]  # no temporary folder left behind
    assert locations.location(f"{root}/latest").read_text().strip() == "step-1"
    assert reading.resolve_checkpoint("latest", root).endswith("/step-1")


def test_failed_write_publishes_nothing_and_keeps_the_previous(root):
    publish(f"{root}/step-1", {"a.bin": b"old"})
    # the body's error becomes the save's CheckpointError (the one every rank raises alike)
    with pytest.raises(locations.CheckpointError, match="nothing was published .*: RuntimeError: disk on fire"):
        with atomic.writing(f"{root}/step-2", kind="training", meta={"step": 2}, pointer=True, comm=Comm()) as w:
            (w.local / "a.bin").write_bytes(b"half")
            raise RuntimeError("disk on fire")
    assert ls(root) == ["latest", "step-1"]  # the partial folder is removed at once
    assert reading.resolve_checkpoint("latest", root).endswith("/step-1")
    assert [c["name"] for c in reading.list_checkpoints(root)] == ["step-1"]
    publish(f"{root}/step-3", {"a.bin": b"new"}, step=3)  # the next save clears the broken leftovers
    assert ls(root) == ["latest", "step-1", "step-3"]


def test_replacing_a_folder_of_the_same_name(root):
    publish(f"{root}/step-1", {"a.bin": b"first", "gone.txt": b"x"})
    publish(f"{root}/step-1", {"a.bin": b"second"})
    folder = locations.location(f"{root}/step-1")
    assert folder.child("a.bin").read_text() == "second"
    assert not folder.child("gone.txt").exists()
    assert ls(root) == ["latest", "step-1"]


def test_latest_falls_back_to_the_newest_complete_checkpoint(root):
    publish(f"{root}/step-2", {"a": b"2"}, step=2)
    publish(f"{root}/step-5", {"a": b"5"}, step=5, pointer=False)
    # `latest` names step-2; break it, as a crash between two publishes could
    remove(locations.location(f"{root}/step-2"))
    assert reading.resolve_checkpoint("latest", root).endswith("/step-5")
    assert reading.resolve_checkpoint(root, root).endswith("/step-5")  # a folder of checkpoints


def test_unfinished_and_missing_checkpoints_are_refused(root, tmp_path):
    publish(f"{root}/step-1", {"a": b"1"})
    unfinished = locations.location(f"{root}/step-9")
    unfinished.fs.makedirs(unfinished.path, exist_ok=True)
    unfinished.fs.pipe_file(unfinished.child("a").path, b"partial")
    with pytest.raises(IncompleteCheckpointError, match=r"no completion marker.*step-1"):
        reading.resolve_checkpoint(unfinished.url, root)
    assert reading.resolve_checkpoint("latest", root).endswith("/step-1")  # never offered
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint folder"):
        reading.resolve_checkpoint(f"{root}/step-404", root)
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        reading.resolve_checkpoint("latest", str(tmp_path / "empty"))


def test_a_model_export_is_not_a_training_checkpoint(root):
    publish(f"{root}/model", {"model.safetensors": b"w"}, kind="model", pointer=False)
    with pytest.raises(WrongKindError, match="model folder, not a training one"):
        reading.resolve_checkpoint(f"{root}/model", root)


def test_verify_names_missing_resized_and_changed_files(tmp_path):
    url = str(tmp_path / "ck" / "step-1")
    publish(url, {"a": b"aaaa", "b": b"bbbb", "c": b"cccc"})
    folder = locations.location(url)
    marker = reading.complete_marker(url)
    assert reading.verify(folder, marker) == []
    (Path(url) / "a").unlink()
    (Path(url) / "b").write_bytes(b"bb")
    (Path(url) / "c").write_bytes(b"cccC")  # same size, other bytes
    assert reading.missing_files(folder, marker) == ["a"]
    problems = reading.verify(folder, marker)
    assert problems[0] == "missing a"
    assert "b has 2 bytes, the manifest says 4" in problems[1]
    assert "c does not match its hash" in problems[2]


def test_damaged_marker_is_reported(tmp_path):
    url = str(tmp_path / "ck" / "step-1")
    publish(url, {"a": b"1"})
    (Path(url) / locations.MARKER).write_text("{not json")
    with pytest.raises(locations.CorruptCheckpointError, match="not valid JSON"):
        reading.complete_marker(url)


def test_fetch_downloads_remote_files(root):
    publish(f"{root}/step-1", {"x/y.bin": b"remote bytes"})
    local, temporary = reading.fetch(locations.location(f"{root}/step-1"), ["x/y.bin"])
    try:
        assert (local / "x" / "y.bin").read_bytes() == b"remote bytes"
        assert temporary == root.startswith("memory://")
    finally:
        if temporary:
            import shutil
            shutil.rmtree(local)


# -- the keep rules ---------------------------------------------------------------------------------
def ck(step: int, loss: float | None = None, saved_by: str = SCHEDULE) -> dict:
    return {"name": f"step-{step}", "step": step, "saved_by": saved_by,
            "metrics": {} if loss is None else {"eval/loss": loss}}


def test_keep_last_deletes_all_but_the_newest_k():
    cks = [ck(s) for s in (2, 4, 6, 8, 10)]
    assert to_delete(cks, keep_last=2, keep_best=0, monitor="eval/loss", mode="min") == ["step-2", "step-4", "step-6"]
    assert to_delete(cks, keep_last=0, keep_best=0, monitor="eval/loss", mode="min") == []  # 0 keeps all


def test_keep_best_by_min_and_max_and_always_the_last():
    cks = [ck(2, 3.0), ck(4, 1.0), ck(6, 2.0), ck(8, 4.0), ck(10)]  # step-10: not evaluated
    assert to_delete(cks, keep_last=1, keep_best=1, monitor="eval/loss", mode="min") == ["step-2", "step-6", "step-8"]
    assert to_delete(cks, keep_last=1, keep_best=2, monitor="loss", mode="max") == ["step-4", "step-6"]
    # keep_last 1 and no best: only the newest, even though it has no metric
    assert to_delete(cks, keep_last=1, keep_best=0, monitor="eval/loss", mode="min") == [
        "step-2", "step-4", "step-6", "step-8"]


def test_hand_saved_checkpoints_are_never_deleted_by_the_rules():
    cks = [ck(1, saved_by="manual"), ck(2), ck(3), ck(4, saved_by="manual"), ck(5)]
    assert to_delete(cks, keep_last=1, keep_best=0, monitor="eval/loss", mode="min") == ["step-2", "step-3"]


def test_ties_keep_the_newer_and_best_checkpoint_lookup():
    cks = [ck(2, 1.0), ck(4, 1.0), ck(6, 5.0)]
    assert to_delete(cks, keep_last=1, keep_best=1, monitor="eval/loss", mode="min") == ["step-2"]
    assert best_checkpoint(cks, "eval/loss", "min")["name"] == "step-4"
    assert best_checkpoint(cks, "eval/loss", "max")["name"] == "step-6"
    assert best_checkpoint([ck(1)], "eval/loss", "min") is None
    assert metric_of({"eval/loss": float("nan")}, "eval/loss") is None


def test_marker_is_plain_json_the_app_can_read(tmp_path):
    url = str(tmp_path / "ck" / "step-3")
    publish(url, {"a": b"1"}, step=3, saved_by=SCHEDULE, metrics={"eval/loss": 1.5})
    marker = json.loads((Path(url) / locations.MARKER).read_text())
    assert marker["format"] == locations.FORMAT and marker["metrics"] == {"eval/loss": 1.5}
