"""When checkpoints go wrong: a save killed mid-write leaves the previous checkpoint intact and
the broken one ignored; a wrong layout, missing files, a corrupt file and an unfinished folder
each give their own clear error and change nothing; fsspec's memory file system round-trips."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import REPO_ROOT, SCRIPTS, deepspeed_command, parse_results, tail
from engine.checkpoint import locations
from engine.checkpoint import reading


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO_ROOT)}


@pytest.mark.slow
def test_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    from engine.checkpoint import atomic

    proc = subprocess.Popen(deepspeed_command(SCRIPTS / "ckpt_kill.py", 2, ("--out", str(tmp_path))),
                            cwd=REPO_ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    flags = [tmp_path / f"stalled-rank{r}" for r in (0, 1)]
    try:
        deadline = time.monotonic() + 600
        while not all(f.exists() for f in flags):
            assert proc.poll() is None, tail(proc.stdout.read())
            assert time.monotonic() < deadline, "the save of step 4 never started"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # every rank, in the middle of writing step 4
        proc.communicate()
    checkpoints = tmp_path / "run" / "checkpoints"
    leftovers = [p.name for p in checkpoints.iterdir() if p.name.startswith(locations.TMP_PREFIX)]
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-step-4-")
    assert any((checkpoints / leftovers[0]).rglob("*.pt"))  # it did get half written
    assert not (checkpoints / "step-4").exists()
    assert [c["name"] for c in reading.list_checkpoints(str(checkpoints))] == ["step-2"]
    assert reading.resolve_checkpoint("latest", str(checkpoints)) == str(checkpoints / "step-2")
    previous = locations.location(str(checkpoints / "step-2"))
    assert reading.verify(previous, reading.complete_marker(previous.url, "training")) == []  # every byte intact


@pytest.mark.slow
def test_bad_checkpoints_give_their_own_error_and_change_nothing(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPTS / "ckpt_errors.py"), "--out", str(tmp_path)],
                          cwd=REPO_ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, tail(proc.stdout + proc.stderr)
    (r,) = parse_results(proc)
    expected = {"missing": ("MissingFilesError", "lacks 1 file(s) its manifest lists: rng/rank00000.pt"),
                "corrupt": ("CorruptCheckpointError", "mp_rank_00_model_states.pt does not match its hash"),
                "unfinished": ("IncompleteCheckpointError", "has no completion marker"),
                "layout": ("LayoutMismatchError", "ZeRO 0 (1 rank); this run is dp 1 x tp 1 x pp 1, ZeRO 2")}
    for case, (error, text) in expected.items():
        assert r[case]["error"] == error, (case, r[case])
        assert text in r[case]["message"], (case, r[case]["message"])
        assert "nothing was loaded" in r[case]["message"] or case in ("unfinished", "layout")
        assert r[case]["unchanged"], case  # weights and position as they were
    assert "set parallel.nproc=1 zero_stage=0" in r["layout"]["message"]
    assert r["good_untouched"]  # the checkpoint itself is never written to by a load
    memory = r["memory"]
    assert memory["moved"] != memory["saved"]
    assert memory["restored"] == memory["saved"] == memory["after_model"]
    assert {"COMPLETE.json", "trainer_state.json", "callbacks.pt", "rng", "global_step2"} <= set(memory["listing"])
