"""`set preference_beta` on a DPO run (issue 29, part 2): the objective's beta changes at the next
boundary (the steps before train with the run's own beta, the later ones with the new one, and
their losses differ from a run left alone), the change is a `set` event and kept in the
checkpoints, and a resume from a checkpoint saved after it replays it exactly: the same beta and
the same losses, step for step. One rank in this process, a tiny model: three short runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.protocol.commands import Set
from contract.run_folder import read_events

BETA = 0.5  # the run's own is preference.beta's default, 0.1


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from conftest import save_tiny_llama
    from engine.data import default_task
    work = tmp_path_factory.mktemp("live-beta")
    save_tiny_llama(work / "model")
    rows = [default_task.preference_row(r) for r in default_task.make_examples(96, 5)]
    (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return work


def _train(inputs: Path, out: Path, *overrides: str, commands: dict | None = None) -> tuple[dict, dict, list]:
    """A DPO run of 8 steps (checkpoints at 4 and 8); `commands` {step: [Set]} sent after that
    step. Returns each step's loss, the objective's beta it trained with, and every reply."""
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.trainer import Trainer

    losses, betas, replies = {}, {}, []

    class Watch(Callback):
        def on_train_batch_end(self, trainer, loss):
            step = trainer.state.global_step
            losses[step] = float(loss)
            betas[step] = trainer.train_fn.objective.beta
            for i, cmd in enumerate((commands or {}).get(step, [])):
                reply = Reply(f"{step}-{i}", replies.append, cmd.returns)  # as the server makes it
                trainer.control.commands.put(f"{step}-{i}", cmd, reply)

    cfg = load_config(overrides=[
        f"output_dir={out}", "max_steps=8", "batch_size=4", "precision=fp32", "train.seed=3",
        "objective=dpo", f"model.path={inputs / 'model'}", f"data.train={inputs / 'pairs.jsonl'}",
        "data.max_length=40", "eval.at_end=false", "eval.every_n_steps=0", "logging.tensorboard=false",
        "checkpoint.every_n_steps=4", "checkpoint.save_at_end=false", "control.enabled=true", *overrides])
    trainer = Trainer(config=cfg, callbacks=[Watch()])
    trainer.train()
    trainer.close()
    return losses, betas, [r for r in replies if r.get("type") in ("done", "error")]


@pytest.mark.slow  # three single-rank DPO trainings in this process
def test_set_preference_beta_changes_the_objective_and_a_resume_replays_it(inputs, tmp_path):
    alone, alone_betas, _ = _train(inputs, tmp_path, "run_name=alone")
    losses, betas, replies = _train(inputs, tmp_path, "run_name=a", commands={2: [Set(preference_beta=BETA)]})
    (reply,) = replies
    assert reply["type"] == "done" and reply["result"]["changes"] == {"preference_beta": BETA}, reply
    assert set(alone_betas.values()) == {0.1}
    assert [betas[s] for s in (1, 2)] == [0.1, 0.1] and all(betas[s] == BETA for s in range(3, 9)), betas
    assert all(losses[s] == alone[s] for s in (1, 2)), (losses, alone)  # the same run up to the change
    assert all(losses[s] != alone[s] for s in range(3, 9)), (losses, alone)  # another beta, another loss
    folder = tmp_path / "a"
    (event,) = [e for e in read_events(folder / "events.jsonl") if e["type"] == "set"]
    assert event["before"]["preference_beta"] == 0.1 and event["changes"]["preference_beta"] == BETA, event
    assert event["applies_from_step"] == 3

    # resumed by hand from step 4: the changed beta is in force and the losses are the first run's
    again, again_betas, _ = _train(inputs, tmp_path, "run_name=b", f"resume={folder / 'checkpoints' / 'step-4'}")
    assert sorted(again) == [5, 6, 7, 8]
    assert {s: again_betas[s] for s in again} == {s: BETA for s in again}
    assert again == {s: losses[s] for s in again}
