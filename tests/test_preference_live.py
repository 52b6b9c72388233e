"""Preferences from the chat, live: a DPO run under ZeRO-3 on 2 ranks through the real entry point
takes pairs (`RunClient.prefer`: the better answer and the worse one for a prompt) at a step
boundary, durably in its inbox, trains on them in the next batches, and a run resumed from a
checkpoint saved after them repeats every later step's loss exactly. One launch and one resumed
launch, a tiny model (CI time)."""

from __future__ import annotations

import json

import pytest

from contract.config.load import load_config
from contract.inbox import read_inbox
from contract.run_folder import make_run_folder
from engine.data import default_task
from supervisor.client import CommandError, RunClient
from supervisor.launch import spawn
from control_runs import _LAUNCHED, CONNECT_S, HEARTBEAT_S, events, logs_of, losses, wait_exit, wait_for_step
from control_runs import end_leftover_runs  # noqa: F401 - autouse: no run outlives its test

pytestmark = pytest.mark.slow
PREFER_AT, STEPS, PER_STEP, FOR_STEPS = 3, 12, 2, 4
PAIRS = {"capital: zorb\n": ("qux", "zorb"), "capital: blim\n": ("fep", "blim")}


def _inputs(tmp_path) -> None:
    from conftest import save_tiny_llama
    save_tiny_llama(tmp_path / "model")
    rows = [default_task.preference_row(r) for r in default_task.make_examples(256, 5)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _launch(tmp_path, name: str, *overrides: str):
    cfg = load_config(overrides=[
        f"output_dir={tmp_path}", f"run_name={name}", "nproc=2", "zero_stage=3", f"max_steps={STEPS}",
        "batch_size=4", "precision=fp32", "objective=dpo", f"model.path={tmp_path / 'model'}",
        f"data.train={tmp_path / 'pairs.jsonl'}", "data.max_length=48", "eval.at_end=false",
        "logging.tensorboard=false", "checkpoint.save_at_end=false", f"teach.per_step={PER_STEP}",
        f"teach.steps={FOR_STEPS}", f"teach.check_after={FOR_STEPS}", "teach.max_new_tokens=4", *overrides])
    run = spawn(cfg, make_run_folder(cfg), extra_env={"LIVETUNE_HEARTBEAT_S": str(HEARTBEAT_S)})
    _LAUNCHED.append(run)
    return run


def test_preferences_from_the_chat_under_zero3_then_an_exact_resume(tmp_path):
    _inputs(tmp_path)
    run = _launch(tmp_path, "prefer")
    client = RunClient.connect(run.folder.root, timeout=CONNECT_S)
    wait_for_step(run, PREFER_AT, timeout=400)
    first = client.pause().step
    with pytest.raises(CommandError, match="dpo trains on preference rows.*teach with `rejected`"):
        client.teach("capital: zorb\n", "qux")  # an answer alone is no pair
    with pytest.raises(CommandError, match="same answer"):
        client.prefer("capital: zorb\n", "qux", "qux")
    taught = {prompt: client.prefer(prompt, *answers) for prompt, answers in PAIRS.items()}
    assert all(t.rejected == PAIRS[p][1] for p, t in taught.items())
    entries = client.inbox().entries
    assert [(e["answer"], e["rejected"]) for e in entries] == list(PAIRS.values())
    client.resume()
    wait_for_step(run, first + FOR_STEPS + 1, timeout=300)
    client.pause()
    saved = client.save()
    client.resume()
    assert wait_exit(run, timeout=400) == 0, logs_of(run)

    log = events(run)
    counts = {e["step"]: e["samples_per_source"] for e in log if e["type"] == "train"}
    for step in range(first + 1, first + FOR_STEPS + 1):  # both pairs, PER_STEP each, in every global batch
        assert counts[step]["inbox"] == 2 * PER_STEP and sum(counts[step].values()) == 8, counts[step]
    assert all("rewards/margins" in e for e in log if e["type"] == "train")
    assert all(isinstance(t.margin, float) for t in taught.values())  # log p(chosen) - log p(rejected)
    checks = [e for e in log if e["type"] == "teach_check"]
    assert {e["id"] for e in checks} == {t.id for t in taught.values()}
    for check in checks:  # which answer the model prefers after FOR_STEPS steps, and the margin's move
        assert check["prefers"] == ("chosen" if check["margin_after"] > 0 else "rejected")
        print(check["id"], check["margin_before"], "->", check["margin_after"], check["prefers"])
    inbox = read_inbox(run.folder.root / "inbox.jsonl")  # durable: the pairs as the run took them
    assert [(e.answer, e.rejected) for e in inbox] == list(PAIRS.values())
    assert all(e.prompt.endswith(p) for e, p in zip(inbox, PAIRS))  # bos included: as the model saw it

    again = _launch(tmp_path, "resumed", f"resume={saved.checkpoint}")
    assert wait_exit(again, timeout=300) == 0, logs_of(again)
    later = {s: v for s, v in losses(run).items() if s > saved.step}
    assert later and {s: v for s, v in losses(again).items() if s > saved.step} == later
