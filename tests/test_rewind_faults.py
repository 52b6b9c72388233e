"""A rewind or branch that fails part-way through its load changes nothing: on 2 ranks, at the
default precision, under ZeRO-3 and under pipeline parallelism (tests/scripts/rewind_fault_check.py).
A failure injected into the optimizer's load -- before it reads, and after it has loaded -- is
answered with its cause in words, the state from before the command is put back on every rank,
and the run trains on with exactly the losses of the same run without the command. When the
state cannot be put back either, the run ends on every rank, saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.branches import BranchTree
from dist_utils import SCRIPTS, default_precision, parse_results, run_deepspeed

PUT_BACK = ("failed while restoring DeepSpeed's model, optimizer and schedule: InjectedFault: injected failure "
            "({mode} the optimizer's load); the run was put back as it was at step {step} (from an in-memory "
            "copy taken before the load) and goes on unchanged")


@pytest.mark.slow
def test_a_failed_load_is_undone_and_the_run_trains_on_unchanged(tmp_path):
    proc = run_deepspeed(SCRIPTS / "rewind_fault_check.py", nproc=2, timeout=900,
                         args=("--layouts", "zero3,pp2", "--lost", "zero3", "--out", str(tmp_path)))
    results = parse_results(proc)
    assert "Traceback" in proc.stdout and "InjectedFault" in proc.stdout  # the rank's log has the cause
    for layout, last in (("zero3", 5), ("pp2", 6)):
        plain = [r for r in results if r["layout"] == layout and not r["faults"]]
        faults = sorted((r for r in results if r["layout"] == layout and r["faults"]), key=lambda r: r["rank"])
        assert len(plain) == 2 and [r["rank"] for r in faults] == [0, 1]
        assert {r["precision"] for r in plain + faults} == {default_precision()}  # what `auto` gives here
        # every rank trained exactly the steps and losses of the run without the commands
        for r in faults:
            assert r["seen"] == plain[0]["seen"][:last], (layout, r["seen"], plain[0]["seen"])
        replies = {r["id"]: r["error"] for r in faults[0]["replies"]}
        assert replies["3-rewind"].startswith("rewind: loading ") and \
            replies["3-rewind"].endswith(PUT_BACK.format(mode="before", step=3)), replies
        assert replies["4-branch"].startswith("branch: loading ") and \
            replies["4-branch"].endswith(PUT_BACK.format(mode="after", step=4)), replies
        folder = Path(faults[0]["folder"])
        assert faults[0]["branch"] == "main" and "b" not in BranchTree.load(folder).branches
        kinds = [json.loads(line)["type"] for line in (folder / "events.jsonl").read_text().splitlines()]
        assert "rewind" not in kinds and "branch" not in kinds
        if layout == "pp2":
            assert all(r["ended"] is None for r in faults)
    for r in (r for r in results if r["layout"] == "zero3" and r["faults"]):
        # the load failed and so did putting the state back: every rank ends, naming both causes
        assert r["ended"].startswith("StateLost: loading ") and "putting back the state from before failed too" in r["ended"]
        assert r["ended"].endswith("so the run cannot go on: resume it from its newest checkpoint")
