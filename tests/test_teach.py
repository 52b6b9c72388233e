"""Teach from the chat and live data sources, on the embedded default model and task under ZeRO-3
on 2 ranks, through the real entry point; then an exact resume after all of it. One launch plus
one resumed launch (CI time): every check of the data commands that needs a running engine is here.

The run trains the default task (a 3,000-row slice of it, quick to tokenize on each rank) to
step TEACH_AT, pauses and measures the held-out exact match, then, while paused:
- adds a second source, and a source with a bad row (kept; the row is reported by number);
  an empty file and an unknown source name are refused, naming them, and nothing changes;
- teaches three instructions the task never had (`capital: <word>` -> a made-up answer), each
  PER_STEP samples of every global batch of 64 for CHECK_AFTER steps; a too-long answer is refused.
Within CHECK_AFTER steps the engine asks each prompt again on its own (teach_check events) and
the live model answers it greedily. At a second pause source b is paused (weight 0), the bad one
removed, a fourth pair taught and at once forgotten (never drawn), a preference sent (`prefer`: an
SFT run trains the chosen answer and ORPO's odds-ratio term for the pair, its reward metrics in
those steps' records, its margin rising), and a checkpoint saved. At the
end the held-out exact match is at least EM_FLOOR and no more than EM_DROP below the one before
the teach. A second run resumed from the checkpoint (rebuilding the live-added sources and the
inbox from their files) gives every later step's loss exactly as the first.

Bounds, measured on the loaded 2-core machine: exact match about 0.1-0.3 at step 170 of a
constant lr 3e-3, rising after it, taught or not; 64 held-out samples are noisy, hence the room.
"""

from __future__ import annotations

import json

import pytest

from contract.config.load import load_config
from contract.inbox import read_inbox
from contract.presets import DEFAULT
from contract.run_folder import make_run_folder
from engine.data import default_task
from supervisor.client import CommandError, RunClient
from supervisor.launch import spawn
from control_runs import _LAUNCHED, CONNECT_S, HEARTBEAT_S, events, logs_of, losses, wait_exit, wait_for_step
from control_runs import end_leftover_runs  # noqa: F401 - autouse: no run outlives its test

pytestmark = pytest.mark.slow
TAUGHT = {"capital: zorb\n": "qux", "capital: blim\n": "fep", "capital: wuzz\n": "tor"}
TEACH_AT, STEPS, PER_STEP, CHECK_AFTER = 170, 215, 4, 25
EM_FLOOR, EM_DROP = 0.1, 0.15
PAIR, PAIR_STEPS = ("capital: quib\n", "nax", "quib"), 4  # prompt, chosen, rejected


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _launch(tmp_path, name: str, *overrides: str):
    cfg = load_config(data=json.loads(json.dumps(DEFAULT)), overrides=[
        f"output_dir={tmp_path}", f"run_name={name}", "nproc=2", "zero_stage=3", f"max_steps={STEPS}",
        "batch_size=32", "precision=fp32", "optim.scheduler=constant", "eval.every_n_steps=0",
        "eval.evaluators=exact_match", "eval.max_samples=64", "eval.at_end=true",
        f"data.train={tmp_path / 'train.jsonl'}", f"data.eval={tmp_path / 'eval.jsonl'}",
        "logging.tensorboard=false", "checkpoint.save_at_end=false", f"teach.per_step={PER_STEP}",
        f"teach.steps={CHECK_AFTER}", f"teach.check_after={CHECK_AFTER}", "teach.max_new_tokens=6", *overrides])
    run = spawn(cfg, make_run_folder(cfg), extra_env={"LIVETUNE_HEARTBEAT_S": str(HEARTBEAT_S)})
    _LAUNCHED.append(run)
    return run


def test_teach_and_live_sources_under_zero3_then_an_exact_resume(tmp_path):
    _write(tmp_path / "train.jsonl", default_task.make_examples(3000, 3, "train"))
    _write(tmp_path / "eval.jsonl", default_task.make_examples(64, 3, "eval"))
    other = _write(tmp_path / "b.jsonl", default_task.make_examples(300, 11, "train"))
    bad = _write(tmp_path / "bad.jsonl", [{"input": "sort: ab\n", "output": "ab"}, {"input": 3},
                                           {"input": "upper: ab\n", "output": "AB"}])
    (tmp_path / "empty.jsonl").write_text("")
    run = _launch(tmp_path, "teach")
    client = RunClient.connect(run.folder.root, timeout=CONNECT_S)
    wait_for_step(run, TEACH_AT, timeout=400)
    first = client.pause().step
    before = client.evaluate().metrics["exact_match"]
    with pytest.raises(CommandError, match="empty.jsonl"):
        client.add_source(str(tmp_path / "empty.jsonl"))
    assert client.add_source(other).source["name"] == "b"
    kept = client.add_source(bad, weight=0.5, name="bad")
    assert "row 2" in " ".join(kept.dropped_rows) and kept.source["samples"] == 2
    with pytest.raises(CommandError, match="no source named 'nope'"):
        client.set_weight("nope", 1.0)
    taught = {prompt: client.teach(prompt, answer) for prompt, answer in TAUGHT.items()}
    with pytest.raises(CommandError, match="longer than data.max_length=32"):
        client.teach("capital: zorb\n", "q" * 40)
    client.resume()
    wait_for_step(run, first + CHECK_AFTER + 2)
    second = client.pause().step
    client.set_weight("b", 0.0)
    client.remove_source("bad")
    dropped = client.teach("capital: dorp\n", "zap").id
    client.forget(dropped)
    assert [(e["id"], e["removed"]) for e in client.inbox().entries][-1] == (dropped, True)
    pair = client.prefer(*PAIR, steps=PAIR_STEPS, check_after=PAIR_STEPS)  # saved with it: the resume replays it
    saved = client.save()
    client.resume()
    assert wait_exit(run, timeout=400) == 0, logs_of(run)

    log = events(run)
    counts = {e["step"]: e["samples_per_source"] for e in log if e["type"] == "train"}
    assert set(counts[first]) == {"train"}
    for step in range(first + 1, first + CHECK_AFTER + 1):  # the three teach schedules
        assert counts[step]["inbox"] == 3 * PER_STEP and sum(counts[step].values()) == 64, counts[step]
    assert sum(counts[s].get("b", 0) + counts[s].get("bad", 0) for s in range(first + 1, second + 1)) > 0
    paired = range(second + 1, second + PAIR_STEPS + 1)  # the pair's steps; the forgotten entry is never drawn
    assert all(counts[s] == ({"train": 64 - PER_STEP, "inbox": PER_STEP} if s in paired else {"train": 64})
               for s in range(second + 1, STEPS + 1)), counts
    records = {e["step"]: e for e in log if e["type"] == "train"}
    assert all(("rewards/margins" in records[s]) == (s in paired) for s in range(first, STEPS + 1))
    changes = [(e["change"], e["source"]["name"]) for e in log if e["type"] == "data"]
    assert changes == [("add", "b"), ("add", "bad"), ("weight", "b"), ("remove", "bad"), ("forget", "inbox")]
    checks = {e["id"]: e for e in log if e["type"] == "teach_check"}
    for prompt, answer in TAUGHT.items():
        check = checks[taught[prompt].id]
        assert taught[prompt].old.strip() != answer  # the task never had it
        assert check["learned"] and check["new"].strip() == answer and check["steps"] <= CHECK_AFTER + 1, check
    assert dropped not in checks
    assert checks[pair.id]["margin_after"] > checks[pair.id]["margin_before"] == pair.margin, checks[pair.id]
    after = [e for e in log if e["type"] == "eval"][-1]["eval/exact_match"]
    print(f"held-out exact match: {before:.3f} before the teach (step {first}), {after:.3f} at step {STEPS}")
    assert after >= EM_FLOOR and after >= before - EM_DROP, (before, after)
    inbox = read_inbox(run.folder.root / "inbox.jsonl")
    assert [(e.answer, e.removed) for e in inbox] == [*((a, False) for a in TAUGHT.values()), ("zap", True),
                                                      ("nax", False)]

    again = _launch(tmp_path, "resumed", f"resume={saved.checkpoint}")
    assert wait_exit(again, timeout=300) == 0, logs_of(again)
    later = {s: v for s, v in losses(run).items() if s > saved.step}
    assert later and {s: v for s, v in losses(again).items() if s > saved.step} == later
