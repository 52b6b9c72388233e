"""The serving budget (control.serving_budget, engine.control.serving): while a run trains, the
OpenAI-compatible API's `complete` requests take at most that share of its wall time (plus one
boundary's worth); the rest wait queued and are all answered. One rank in this process (the
client in a thread, through the real socket), a tiny model."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.config.schema import ConfigError
from contract.protocol.completion_commands import Complete
from contract.run_folder import read_events
from supervisor.client import RunClient
from control_runs import CONNECT_S

BUDGET, REQUESTS = 0.05, 4


def test_a_budget_outside_zero_to_one_is_refused():
    """(The budget's rule on a clock of our own: tests/test_openai_budget.py.)"""
    with pytest.raises(ConfigError, match="serving_budget"):
        load_config(overrides=["control.serving_budget=1.5"])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from conftest import save_tiny_llama
    from engine.data import default_task
    work = tmp_path_factory.mktemp("serving")
    save_tiny_llama(work / "model")
    rows = default_task.make_examples(128, 5)
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return work


@pytest.mark.slow  # one single-rank training in this process (~20 s)
def test_a_training_run_answers_every_request_within_its_serving_budget(inputs, tmp_path):
    from engine.trainer import Trainer
    cfg = load_config(overrides=[
        f"output_dir={tmp_path}", "run_name=served", "max_steps=100000", "batch_size=4", "precision=fp32",
        f"model.path={inputs / 'model'}", f"data.train={inputs / 'train.jsonl'}", "data.max_length=48",
        "eval.at_end=false", "eval.every_n_steps=0", "logging.tensorboard=false",
        "checkpoint.save_at_end=false", "control.enabled=true", f"control.serving_budget={BUDGET}"])
    trainer = Trainer(config=cfg)
    answers, failures, status = [], [], {}

    def talk() -> None:
        try:
            with RunClient.connect(trainer.folder.root, timeout=CONNECT_S) as client:
                for i in range(REQUESTS):  # one after another: each alone at its boundary
                    asked = Complete(prompts=[f"reverse: kernel{i}\n"], max_new_tokens=24, temperature=0)
                    answers.append(client.stream(asked, timeout=300).wait())
                status.update(client.status().wire())
                client.stop(save=False)
        except Exception as e:  # noqa: BLE001 - reported by the test
            failures.append(e)
            RunClient.connect(trainer.folder.root).stop(save=False)

    thread = threading.Thread(target=talk, daemon=True)
    thread.start()
    trainer.train()
    thread.join(timeout=60)
    folder = trainer.folder
    trainer.close()
    assert not failures, failures
    assert len(answers) == REQUESTS and all(a.choices[0]["token_ids"] for a in answers)
    serving = status["serving"]
    assert serving["budget"] == BUDGET and serving["held"] > 0, serving  # some had to wait
    assert 0 < serving["served_s"] <= BUDGET * serving["elapsed_s"] + serving["largest_s"], serving
    done = [e for e in read_events(folder.events)
            if e["type"] == "command" and e["cmd"] == "complete" and e["status"] == "done"]
    # the budget charged what the answers took: each answer's own seconds (a separate timer around
    # a little less work, rounded) add up to about the charged seconds, never much more
    assert len(done) == REQUESTS and sum(e["seconds"] for e in done) <= 1.1 * serving["served_s"] + 0.005
    assert {e["step"] for e in done} != {done[0]["step"]}  # answered while it trained on
