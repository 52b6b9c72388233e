"""Live data changes on a 2-rank run through the real entry point, and an exact resume after them.

One run: paused at its first boundary, it is given a second source, a source with a bad row
(kept, the row reported by number), an empty file (refused, naming it, nothing changes), a teach
(2 inbox samples in each of the next 6 batches) and a too-long answer (refused); it trains on,
pauses again, pauses source b (weight 0) and removes the bad one, saves a checkpoint and trains
to the end. The per-step source counts in its train events show each change from the next step
on. A second run resumed from that checkpoint (rebuilding the live-added sources and the inbox
from their files) then gives every later step's loss exactly as the first run did.
"""

from __future__ import annotations

import json

import pytest

from contract.inbox import read_inbox
from engine import default_task
from supervisor.client import CommandError, RunClient
from control_runs import end_leftover_runs  # noqa: F401 - autouse: no run outlives its test
from control_runs import CONNECT_S, events, launch, logs_of, losses, task_files, wait_exit, wait_for_step

pytestmark = pytest.mark.slow
SETTINGS = ("max_steps=16", "batch_size=4", "teach.check_after=2", "teach.max_new_tokens=8")


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_live_sources_and_teach_then_an_exact_resume(tmp_path):
    task = task_files(tmp_path / "task")
    other = _write(tmp_path / "b.jsonl", default_task.make_examples(300, 11, "train"))
    bad = _write(tmp_path / "bad.jsonl", [{"input": "sort: ab\n", "output": "ab"}, {"input": 3},
                                           {"input": "upper: ab\n", "output": "AB"}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    run = launch(tmp_path, "live", task, *SETTINGS)
    client = RunClient.connect(run.folder.root, timeout=CONNECT_S)
    first = client.pause()["step"]
    with pytest.raises(CommandError, match="empty.jsonl"):
        client.add_source(str(empty))
    added = client.add_source(other)
    assert added["source"]["name"] == "b" and added["applies_from_step"] == first + 1
    kept = client.add_source(bad, weight=0.5, name="bad")
    assert "row 2" in " ".join(kept["dropped_rows"]) and kept["source"]["samples"] == 2
    with pytest.raises(CommandError, match="no source named 'nope'"):
        client.set_weight("nope", 1.0)
    taught = client.teach("capital: zorb\n", "qux", per_step=2, steps=6)
    assert taught["id"] == "t1" and taught["prompt"].endswith("capital: zorb\n")
    with pytest.raises(CommandError, match="longer than data.max_length=32"):
        client.teach("capital: zorb\n", "q" * 40)
    client.resume()
    wait_for_step(run, first + 3)
    second = client.pause()["step"]
    client.set_weight("b", 0.0)
    client.remove_source("bad")
    saved = client.save()
    client.resume()
    assert wait_exit(run) == 0, logs_of(run)

    log = events(run)
    counts = {e["step"]: e["samples_per_source"] for e in log if e["type"] == "train"}
    assert set(counts[first]) == {"train"} or first == 0  # before the changes: the one source
    for step in range(first + 1, first + 7):  # the teach schedule: 2 of each global batch of 8
        assert counts[step]["inbox"] == 2 and sum(counts[step].values()) == 8, counts[step]
    assert sum(counts[s].get("b", 0) for s in range(first + 1, second + 1)) > 0
    assert all(set(counts[s]) <= {"train", "inbox"} for s in range(second + 1, 17)), counts
    changes = [(e["change"], e["source"]["name"]) for e in log if e["type"] == "data"]
    assert changes == [("add", "b"), ("add", "bad"), ("weight", "b"), ("remove", "bad")]
    check = next(e for e in log if e["type"] == "teach_check")
    assert check["id"] == "t1" and check["steps"] >= 2 and {"old", "new", "learned"} <= set(check)
    assert [(e.id, e.answer) for e in read_inbox(run.folder.root / "inbox.jsonl")] == [("t1", "qux")]

    again = launch(tmp_path, "resumed", task, *SETTINGS, f"resume={saved['checkpoint']}")
    assert wait_exit(again) == 0, logs_of(again)
    before, after = losses(run), losses(again)
    later = {s: v for s, v in before.items() if s > saved["step"]}
    assert later and {s: v for s, v in after.items() if s > saved["step"]} == later
