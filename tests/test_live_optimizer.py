"""Every optimizer setting live (engine.control.live_fields): `set weight_decay / betas / eps /
optimizer={...} / preference_beta / serving_budget` changes the optimizer's parameter groups (and
the run's parts) at the next boundary, a refusal names the field and the rule, each change is a
`set` event and is kept in the checkpoints, and a resume from a checkpoint replays it exactly: its
losses and its groups' fields are the first run's, step for step. One rank in this process, a tiny
model: two short runs (~15 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.protocol.base import ProtocolError
from contract.protocol.commands import Set, command_from_wire
from contract.run_folder import read_events

CHANGES = Set(weight_decay=0.25, betas=[0.8, 0.95], eps=1e-6, serving_budget=0.5)


def test_the_contract_names_the_field_and_its_rule():
    for args, words in (({"betas": [0.9, 1.0]}, "betas' must be two numbers each in [0, 1)"),
                        ({"eps": 0}, "'eps' must be above 0.0"), ({"weight_decay": -1}, "'weight_decay' must be at least 0"),
                        ({"serving_budget": 2}, "'serving_budget' must be at least 0.0 and at most 1.0")):
        with pytest.raises(ProtocolError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            command_from_wire("set", args)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from conftest import save_tiny_llama
    from engine.data import default_task
    work = tmp_path_factory.mktemp("live-optimizer")
    save_tiny_llama(work / "model")
    rows = default_task.make_examples(96, 5)
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return work


def _train(inputs: Path, out: Path, *overrides: str, commands: dict | None = None) -> tuple[dict, dict, list]:
    """A run of 8 steps (checkpoints at 4 and 8); `commands` {step: [Set]} sent after that step.
    Returns each step's loss and the decaying group's fields after it, and every reply."""
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.trainer import Trainer

    losses, fields, replies = {}, {}, []

    class Watch(Callback):
        def on_train_batch_end(self, trainer, loss):
            step = trainer.state.global_step
            losses[step] = float(loss)
            group = trainer.optimizer.param_groups[0]
            fields[step] = {k: group[k] for k in ("weight_decay", "betas", "eps")}
            fields[step]["no_decay"] = trainer.optimizer.param_groups[-1]["weight_decay"]
            fields[step]["serving"] = trainer.control.serving.share
            for i, cmd in enumerate((commands or {}).get(step, [])):
                reply = Reply(f"{step}-{i}", replies.append, cmd.returns)  # as the server makes it
                trainer.control.commands.put(f"{step}-{i}", cmd, reply)

    cfg = load_config(overrides=[
        f"output_dir={out}", "max_steps=8", "batch_size=4", "precision=fp32", "train.seed=3",
        f"model.path={inputs / 'model'}", f"data.train={inputs / 'train.jsonl'}", "data.max_length=40",
        "eval.at_end=false", "eval.every_n_steps=0", "logging.tensorboard=false", "optim.weight_decay=0.01",
        "checkpoint.every_n_steps=4", "checkpoint.save_at_end=false", "control.enabled=true", *overrides])
    trainer = Trainer(config=cfg, callbacks=[Watch()])
    trainer.train()
    trainer.close()
    return losses, fields, [r for r in replies if r.get("type") in ("done", "error")]


@pytest.mark.slow  # two single-rank trainings in this process
def test_set_changes_the_groups_at_the_next_boundary_and_a_resume_replays_it(inputs, tmp_path):
    refused = [Set(optimizer={"momentum": 0.5}), Set(optimizer={"eps": -1.0}), Set(preference_beta=0.2)]
    losses, fields, replies = _train(inputs, tmp_path, "run_name=a", commands={2: [CHANGES, *refused]})
    by_id = {r["id"]: r for r in replies}
    assert by_id["2-0"]["result"]["changes"] == {"weight_decay": 0.25, "betas": [0.8, 0.95], "eps": 1e-6,
                                                 "serving_budget": 0.5}
    # before the boundary the run's own fields; from step 3 on the new ones (the no-decay group keeps 0)
    assert fields[2] == {"weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "no_decay": 0.0, "serving": 0.05}
    assert fields[3] == fields[8] == {"weight_decay": 0.25, "betas": (0.8, 0.95), "eps": 1e-6, "no_decay": 0.0,
                                      "serving": 0.5}
    errors = [by_id[f"2-{i}"].get("message", "") for i in (1, 2, 3)]
    assert "momentum is not one of its fields (AdamW's fields: " in errors[0] and "betas" in errors[0], errors
    assert "AdamW refuses it: Invalid epsilon value: -1.0" in errors[1], errors
    assert "preference_beta needs a preference objective" in errors[2], errors
    folder = tmp_path / "a"
    (event,) = [e for e in read_events(folder / "events.jsonl") if e["type"] == "set"]
    assert event["before"]["weight_decay"] == 0.01 and event["changes"]["betas"] == [0.8, 0.95]
    assert event["applies_from_step"] == 3

    # resumed by hand from step 4: the same losses and fields from step 5 on
    again, again_fields, _ = _train(inputs, tmp_path, "run_name=b", f"resume={folder / 'checkpoints' / 'step-4'}")
    assert sorted(again) == [5, 6, 7, 8]
    assert {s: again[s] for s in again} == {s: losses[s] for s in again}
    assert {s: again_fields[s] for s in again} == {s: fields[s] for s in again}
