"""A full disk and a failed save, on a small tmpfs mounted by each test.

In one process (atomic.writing itself): a save that fills the disk in the middle fails as
DiskFullError naming the folder, the space needed and free, leaves no partial folder and marks
nothing complete; one that cannot fit is refused before it starts, with a warning event; a file
cut short is never marked complete. On 2 real DeepSpeed ranks (slow): a save that fails on one
rank only fails on both, the run trains on and the event names the failure; a scheduled save on
a full disk ends the run with the disk-full message, and the resumed run, allowed to delete old
checkpoints, makes room by its keep rules and repeats the losses.
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
from engine.checkpoint import locations
from engine.checkpoint import reading

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
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((locations.TMP_PREFIX, locations.OLD_PREFIX)))


def test_the_disk_filling_in_the_middle_of_a_save_fails_it_as_a_full_disk(small_disk):
    ckpts = small_disk / "checkpoints"
    save(ckpts / "step-1", 2 * MiB)  # small: the estimate for the next save says it fits
    free_before = space.free_bytes(small_disk)
    events: list[dict] = []
    fill(small_disk, leave=6 * MiB)
    with pytest.raises(locations.DiskFullError) as caught:
        save(ckpts / "step-2", 12 * MiB, emit=lambda e: events.append(e.record()))
    message = str(caught.value)
    assert message.startswith("disk full: saving ") and str(ckpts / "step-2") in message
    assert "needs about 2.0 MiB (the size of step-1)" in message   # needed, from the previous checkpoint
    assert f"{str(ckpts)} had 6.0 MiB free" in message or "MiB free" in message
    assert "step-1, is untouched" in message
    assert caught.value.free is not None and 5 * MiB < caught.value.free <= 6 * MiB + MiB
    assert leftovers(ckpts) == []                                   # the partial folder is gone
    assert not (ckpts / "step-2").exists()
    assert [c["name"] for c in reading.list_checkpoints(str(ckpts))] == ["step-1"]
    assert reading.resolve_checkpoint("latest", str(ckpts)) == str(ckpts / "step-1")
    step1 = locations.location(str(ckpts / "step-1"))
    assert reading.verify(step1, reading.complete_marker(step1.url, "training")) == []
    (failed,) = [e for e in events if e["type"] == "checkpoint_failed"]
    assert failed["disk_full"] and not failed["foreseen"] and failed["path"] == str(ckpts / "step-2")
    (small_disk / "filler").unlink()
    assert space.free_bytes(small_disk) == free_before               # nothing of the partial save is left
    save(ckpts / "step-2", 12 * MiB)                                  # room again: it goes through
    assert [c["name"] for c in reading.list_checkpoints(str(ckpts))] == ["step-1", "step-2"]


def test_a_first_save_that_fills_the_disk_says_how_much_it_wrote(small_disk):
    ckpts = small_disk / "checkpoints"
    fill(small_disk, leave=5 * MiB)
    with pytest.raises(locations.DiskFullError) as caught:
        save(ckpts / "step-1", 12 * MiB)
    assert "needs more than the" in str(caught.value) and "written before the disk filled" in str(caught.value)
    assert "no complete checkpoint is there yet" in str(caught.value)
    assert leftovers(ckpts) == [] and not (ckpts / "step-1").exists()


def test_a_save_that_cannot_fit_is_refused_before_it_starts_with_a_warning(small_disk):
    ckpts = small_disk / "checkpoints"
    save(ckpts / "step-1", 12 * MiB)
    size = space.manifest_bytes(reading.complete_marker(str(ckpts / "step-1")))
    fill(small_disk, leave=8 * MiB)
    free = space.free_bytes(small_disk)
    events: list[dict] = []
    with pytest.raises(locations.DiskFullError) as caught:
        save(ckpts / "step-2", 12 * MiB, emit=lambda e: events.append(e.record()))
    assert caught.value.foreseen and caught.value.needed == size and caught.value.free == free
    assert f"needs about {space.mb(size)} (the size of step-1)" in str(caught.value)
    assert f"has {space.mb(free)} free, so the save was not started" in str(caught.value)
    warning, failed = events
    assert warning["type"] == "warning" and warning["needed_bytes"] == size and warning["free_bytes"] == free
    assert failed["type"] == "checkpoint_failed" and failed["foreseen"]
    assert space.free_bytes(small_disk) == free and leftovers(ckpts) == []  # nothing was written


def test_a_file_cut_short_is_never_marked_complete(tmp_path):
    target = tmp_path / "checkpoints" / "step-1"
    with pytest.raises(locations.CheckpointError, match=r"model.pt \(a zip archive without its end\)"):
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
    with pytest.raises(locations.CheckpointError, match="PermissionError: .*Permission denied") as caught:
        with atomic.writing(str(target), kind="training", meta={"step": 1}) as w:
            with w.deferring(writer, "save"):
                assert writer.save("a") is None  # noted, not raised: the body goes on
                writer.save("b")                  # after a failure nothing more is written
            assert "save" not in vars(writer)     # the method is the class's again
    assert writer.calls == 1 and not isinstance(caught.value, locations.DiskFullError)
    assert not target.exists() and leftovers(target.parent) == []


# -- 2 ranks -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def failing_writes(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One launch (a 2-rank start costs more than the steps) for the two injected write failures:
    a save failing on rank 1 (ZeRO 2), then a ZeRO-3 export filling the disk (part "export")."""
    from dist_utils import SCRIPTS, parse_results, run_deepspeed

    out = tmp_path_factory.mktemp("writes")
    proc = run_deepspeed(SCRIPTS / "ckpt_disk.py", 2, ("--out", str(out), "--export"), timeout=800)
    return out, parse_results(proc)


@pytest.mark.slow
def test_a_save_that_fails_on_one_rank_fails_on_both_and_training_goes_on(failing_writes):
    tmp_path, results = failing_writes
    (r,) = [r for r in results if r["part"] == "save"]
    assert r["step"] == r["total"] == 6            # trained to the end: nobody waited in the save
    assert r["saved"] == [4, 6] and r["listing"] == ["latest", "step-4", "step-6"]  # no partial folder
    (failed,) = r["failed"]
    assert failed["path"] == str(tmp_path / "run" / "checkpoints" / "step-2") and not failed["disk_full"]
    assert "rank 1: PermissionError: [Errno 13] Permission denied" in failed["error"]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in failed["error"]
    assert sorted(r["losses"], key=int) == [str(s) for s in range(1, 7)]


@pytest.mark.slow
def test_save_now_on_a_full_disk_is_answered_and_training_goes_on(tmp_path):
    from control_runs import CONNECT_S, launch, task_files, wait_exit, wait_for_step
    from supervisor.client import CommandError, RunClient

    ckpts = tmp_path / "runs" / "full" / "checkpoints"
    with tmpfs(ckpts, "40m"):
        run = launch(tmp_path, "full", task_files(tmp_path / "task"), "max_steps=100000")
        try:
            with RunClient.connect(run.folder.root, timeout=CONNECT_S) as client:
                filler = fill(ckpts, leave=2 * MiB)   # a first save, with nothing to estimate from
                with pytest.raises(CommandError, match="save failed: DiskFullError: disk full: saving ") as full:
                    client.save()
                assert "written before the disk filled" in str(full.value) and str(ckpts) in str(full.value)
                assert [p.name for p in ckpts.iterdir()] == ["filler"]  # the partial folder is gone
                step = client.status().step
                wait_for_step(run, step + 3)           # training goes on
                filler.unlink()
                first = client.save()                  # room again: it succeeds
                size = space.manifest_bytes(reading.complete_marker(first.checkpoint))
                filler = fill(ckpts, leave=size // 2)
                with pytest.raises(CommandError, match="so the save was not started") as foreseen:
                    client.save()
                assert f"needs about {space.mb(size)}" in str(foreseen.value)
                step = client.status().step
                wait_for_step(run, step + 3)
                filler.unlink()
                second = client.save()
                assert second.step > first.step
                fill(ckpts, leave=size // 2)
                stopped = client.stop(save=True)       # a stop stops, even when its save fails
                assert stopped.checkpoint is None and not stopped.final_model
                assert stopped.save_error.startswith("disk full: saving ")
            assert wait_exit(run) == 0
        finally:
            from control_runs import end_run
            end_run(run, grace_s=5.0)
    kinds = [e for e in map(json.loads, run.folder.events.read_text().splitlines())
             if e["type"] in ("warning", "checkpoint_failed")]
    assert [e["type"] for e in kinds] == ["checkpoint_failed", *["warning", "checkpoint_failed"] * 2], kinds
    assert kinds[0]["disk_full"] and not kinds[0]["foreseen"] and kinds[2]["foreseen"]
    assert kinds[1]["needed_bytes"] == size and kinds[1]["free_bytes"] < size


def cli_run(tmp_path: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LIVETUNE_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "app.cli", "train", f"output_dir={tmp_path / 'runs'}", f"run_name={name}",
           "nproc=2", "data.max_length=32", "batch_size=8", "precision=fp32", "logging.tensorboard=false",
           "eval.every_n_steps=0", "eval.at_end=false", "checkpoint.save_at_end=false", "max_steps=8",
           "checkpoint.every_n_steps=2", *args]
    return subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True,
                          text=True, timeout=600)


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
            if e["type"] == "train"]


@pytest.mark.slow
def test_a_full_disk_ends_the_run_and_the_resume_makes_room_by_the_keep_rules_and_repeats_the_losses(tmp_path):
    """With nothing it may delete (keep_last=0) a scheduled save on a full disk ends the run with
    its message; resumed on the same full disk with keep_last=2, the keep rules make room before
    each save (step-2 before step-6, step-4 before step-8) and the run trains to its end,
    repeating the first run's losses. (One run of each: a 2-rank start costs more than its steps.)"""
    run_dir = tmp_path / "runs" / "full"
    ckpts = run_dir / "checkpoints"
    with tmpfs(ckpts, "13m"):                            # two checkpoints (5 MiB) fit, a third does not
        first = cli_run(tmp_path, "full", "checkpoint.keep_last=0")
        out = first.stdout + first.stderr
        assert first.returncode == 1, out[-3000:]
        assert "disk full: saving " + str(ckpts / "step-6") in out and "MiB free" in out, out[-3000:]
        assert "step-4 stays the newest complete one" in out
        assert [c["name"] for c in reading.list_checkpoints(str(ckpts))] == ["step-2", "step-4"]
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-2", "step-4"]
        before = dict(train_losses(run_dir))
        second = cli_run(tmp_path, "full", "checkpoint.keep_last=2", "resume=latest")  # the disk still full
        out2 = second.stdout + second.stderr
        assert second.returncode == 0, out2[-3000:]
        assert "finished" in out2 and "run failed" not in out2
        assert [c["name"] for c in reading.list_checkpoints(str(ckpts))] == ["step-6", "step-8"]
    resumed = dict(train_losses(run_dir)[len(before):])
    assert sorted(resumed) == list(range(5, 9))          # from step-4 on, to the end
    assert {s: resumed[s] for s in (5, 6)} == {s: before[s] for s in (5, 6)}  # repeated exactly
    deleted = [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
               if e["type"] == "checkpoint_deleted" and "disk full" in e.get("reason", "")]
    assert [d["names"] for d in deleted] == [["step-2"], ["step-4"]]


@pytest.mark.slow
def test_a_model_export_under_zero3_that_fills_the_disk_fails_on_both_ranks_without_a_hang(failing_writes):
    """Rank 0's shard write fails mid-export while rank 1 waits in the ZeRO-3 gathers: rank 0
    goes on through them, both ranks get the same DiskFullError, nothing is published, and the
    next export succeeds and loads in transformers."""
    tmp_path, results = failing_writes
    by_rank = {r["rank"]: r for r in results if r["part"] == "export"}
    assert sorted(by_rank) == [0, 1]
    for r in by_rank.values():
        assert r["error"]["type"] == "DiskFullError", r["error"]
        assert str(tmp_path / "export" / "model") in r["error"]["text"]
        assert "rank 0: OSError: [Errno 28] No space left on device" in r["error"]["text"]
    assert by_rank[0]["listing"] == ["model"]  # the partial folder is gone
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(by_rank[0]["model"])
    assert sum(p.numel() for p in model.parameters()) > 0
