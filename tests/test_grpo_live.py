"""A GRPO run steered while it trains (engine.objectives.grpo_live, docs/rewards.md "Live"): `set`
changes the reward weights and the sampling settings, `add_reward` / `remove_reward` change the
reward functions, each from the next step on (the step's metrics show it); a refusal names the
field; every change is a `set` event, kept in the checkpoints, and a resume from a checkpoint taken
after them repeats the losses, rewards and weights bit for bit. Commands go in as the server queues
them, through RunClient's verbs and through the terminal's `command` (each waited for until queued,
so it applies at the boundary meant). One rank in this process, a tiny Llama."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.protocol.base import ProtocolError
from contract.protocol.commands import Set, command_from_wire
from contract.protocol.reward_commands import AddReward, RemoveReward
from contract.run_folder import read_events

BAD = '''
def two_args(prompts, completions):  # no **kwargs: TRL passes the columns by keyword
    return [0.0] * len(completions)
'''


def test_the_contract_checks_the_new_fields_and_entries():
    for cmd, args, words in (
            ("set", {"grpo_num_generations": 1}, "'grpo_num_generations' must be at least 2"),
            ("set", {"grpo_top_p": 1.5}, "'grpo_top_p' must be at least 0.01 and at most 1.0"),
            ("set", {"grpo_temperature": 0}, "'grpo_temperature' must be at least 0.01"),
            ("set", {"grpo_beta": -1}, "'grpo_beta' must be at least 0"),
            ("add_reward", {"reward": {"kind": "nope"}}, "reward.kind: 'nope' is not a built-in"),
            ("add_reward", {"reward": {"kind": "regex", "column": "a"}}, "unknown keys ['column'] for regex"),
            ("add_reward", {"reward": {"kind": "regex", "function": "m:f"}}, "give exactly one of kind"),
            ("remove_reward", {"reward": ""}, "remove_reward: argument 'reward'")):
        with pytest.raises(ProtocolError) as refused:
            command_from_wire(cmd, args)
        assert words in str(refused.value), (args, str(refused.value))
    assert AddReward(reward={"function": "m:f", "weight": 2}).reward["weight"] == 2


def test_the_front_ends_read_the_weights_box():
    from app import live_settings
    from app.session import SessionError
    assert live_settings.changes({"reward_weights": "exact_match=0.5, vowel = 2", "grpo_temperature": "0.7"}) == {
        "reward_weights": {"exact_match": 0.5, "vowel": 2.0}, "grpo_temperature": 0.7}
    assert live_settings.label("grpo_max_completion_length") == "GRPO max completion length"
    with pytest.raises(SessionError, match="Reward weights: must be reward=weight pairs"):
        live_settings.changes({"reward_weights": "exact_match"})
    assert ("Reward weights", "exact_match 0.5, vowel 2") in live_settings.present(
        {"reward_weights": {"exact_match": 0.5, "vowel": 2.0}})
    assert live_settings.weights_hint({"reward_weights": {"exact_match": 0.5, "vowel": 2.0}}) == \
        "exact_match=0.5, vowel=2"
    # the web fold's add / remove: an entry as a config writes one (YAML or JSON)
    assert live_settings.reward_entry("{function: my_rewards.py:brevity, weight: 0.2}") == {
        "function": "my_rewards.py:brevity", "weight": 0.2}
    assert live_settings.reward_entry('{"kind": "regex", "pattern": "a+"}') == {"kind": "regex", "pattern": "a+"}
    for text in ("", "regex", "{kind: [}"):
        with pytest.raises(SessionError, match="^Reward: "):
            live_settings.reward_entry(text)


def test_the_train_tab_has_the_reward_controls(tmp_path):
    from app.web import build_app
    from app.web.backend import Backend
    backend = Backend(tmp_path / "runs")
    try:
        ids = {getattr(block, "elem_id", None) for block in build_app(backend).blocks.values()}
    finally:
        backend.close()
    assert {"train-set-reward_weights", "train-set-grpo_temperature", "train-reward-entry", "train-reward-add",
            "train-reward-name", "train-reward-remove"} <= ids


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from conftest import save_tiny_llama
    from engine.data import default_task
    work = tmp_path_factory.mktemp("grpo-live")
    save_tiny_llama(work / "model")
    rows = [{"prompt": r["input"], "answer": r["output"]} for r in default_task.make_examples(48, 5)]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "bad.py").write_text(BAD)
    return work


def _train(inputs: Path, out: Path, *overrides: str, commands: dict | None = None, steps: int = 6):
    """A run of `steps` GRPO steps (checkpoint at 4); `commands` {step: [command]} sent after that
    step. Returns the train records by step, the step's sampling temperature, every reply."""
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.trainer import Trainer

    temperatures, replies, threads = {}, [], []
    name = next(o.split("=", 1)[1] for o in overrides if o.startswith("run_name="))

    class Watch(Callback):
        def on_train_batch_end(self, trainer, loss):
            step = trainer.state.global_step
            temperatures[step] = getattr(getattr(trainer.train_fn, "config", None), "temperature", None)
            # the weights after the step (the loss of a first GRPO iteration is ~0 by construction)
            temperatures[f"weights-{step}"] = [float(p.detach().double().sum()) for p in trainer.engine.module.parameters()]
            for i, cmd in enumerate((commands or {}).get(step, [])):
                if callable(cmd):  # a client's verb, over the socket: queued before this boundary
                    _through_the_client(trainer, out / name, cmd, replies, f"{step}-{i}", threads)
                    continue
                trainer.control.commands.put(f"{step}-{i}", cmd, Reply(f"{step}-{i}", replies.append, cmd.returns))

    cfg = load_config(overrides=[
        f"output_dir={out}", f"max_steps={steps}", "batch_size=2", "precision=fp32", "train.seed=3",
        f"model.path={inputs / 'model'}", f"data.train={inputs / 'prompts.jsonl'}", "data.max_length=40",
        "eval.at_end=false", "eval.every_n_steps=0", "logging.tensorboard=false", "lr=5e-3",
        "optim.scheduler=constant", "checkpoint.every_n_steps=4", "checkpoint.save_at_end=false",
        "control.enabled=true", *overrides])
    trainer = Trainer(config=cfg, callbacks=[Watch()])
    trainer.train()
    trainer.close()
    for thread in threads:
        thread.join(timeout=60)
    train = {e["step"]: e for e in read_events(out / name / "events.jsonl") if e["type"] == "train"}
    return train, temperatures, {r["id"]: r for r in replies if r.get("type") in ("done", "error")}


def _through_the_client(trainer, folder: Path, verb, replies: list, request: str, threads: list) -> None:
    """Call `verb(client, folder)` in a thread (its answer comes at the boundary after this step) and wait
    until the run has queued it, so it applies at this boundary, never a later one."""
    from supervisor.client import RunClient
    before = len(trainer.control.commands)

    def call() -> None:
        with RunClient.connect(folder) as client:
            try:
                answer = verb(client, folder)
                replies.append({"id": request, "type": "done",
                                "result": answer if isinstance(answer, dict) else answer.model_dump()})
            except Exception as e:  # noqa: BLE001 - the refusal, as the run words it
                replies.append({"id": request, "type": "error", "message": str(e)})

    threads.append(threading.Thread(target=call, daemon=True))
    threads[-1].start()
    deadline = time.monotonic() + 60
    while len(trainer.control.commands) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(trainer.control.commands) > before, "the client's command was not queued"


def _terminal(folder: Path, *argv: str) -> dict:
    """`./launch.sh command FOLDER ...` (app.cli_command): its printed answer."""
    from app.cli_command import command
    said: list[str] = []
    assert command([str(folder), *argv], lambda text, *style: said.append(text)) == 0, said
    return json.loads(said[-1])


GRPO = ("objective=grpo", "grpo.num_generations=4", "grpo.max_completion_length=4", "grpo.loss_type=grpo",
        "grpo.temperature=1.0",
        "grpo.rewards=[{kind: regex, pattern: '[aeiou]', name: vowel}, {kind: exact_match, column: answer}]")


@pytest.mark.slow  # two GRPO runs and a step of SFT, one rank in this process (~30 s)
def test_set_add_and_remove_rewards_live_and_a_resume_repeats_them(inputs, tmp_path):
    early = {"kind": "regex", "pattern": "[a-m]", "name": "early", "weight": 1.0}
    add_early = f"reward={json.dumps(early)}"  # from the terminal
    commands = {2: [Set(reward_weights={"vowel": 0.5}, grpo_temperature=0.7),
                    lambda client, folder: _terminal(folder, "add_reward", add_early),
                    Set(reward_weights={"nope": 1.0}), AddReward(reward={"function": "no_such_module:f"}),
                    AddReward(reward={"function": f"{inputs / 'bad.py'}:two_args"}),
                    AddReward(reward={"kind": "format", "name": "vowel"})],
                3: [lambda client, _: client.remove_reward("exact_match"), RemoveReward(reward="nope"),
                    RemoveReward(reward="early"), lambda client, _: client.remove_reward("vowel")]}
    train, seen, replies = _train(inputs, tmp_path, "run_name=a", *GRPO, commands=commands)
    assert replies["2-0"]["result"]["changes"] == {"reward_weights": {"vowel": 0.5, "exact_match": 1.0},
                                                   "grpo_temperature": 0.7}
    assert [r["name"] for r in replies["2-1"]["result"]["rewards"]] == ["vowel", "exact_match", "early"]
    errors = {k: replies[k].get("message", "") for k in ("2-2", "2-3", "2-4", "2-5", "3-1", "3-3")}
    assert "set: reward_weights: 'nope' is not a reward of this run (its rewards: vowel, exact_match" in errors["2-2"]
    assert "add_reward: reward.function: cannot import 'no_such_module'" in errors["2-3"], errors
    assert "two_args has the signature (prompts, completions); a reward function takes" in errors["2-4"], errors
    assert "already has a reward named 'vowel'" in errors["2-5"], errors
    assert "remove_reward: reward: 'nope' is not a reward of this run" in errors["3-1"], errors
    assert "'vowel' is the run's only reward" in errors["3-3"], errors

    # each change from the next step on: step 3 scores with the three (the vowels at half weight) at
    # temperature 0.7, step 4 with the vowels only
    assert seen[2] == 1.0 and seen[3] == seen[6] == 0.7
    assert "rewards/early/mean" not in train[2] and train[2]["reward"] == pytest.approx(
        train[2]["rewards/vowel/mean"] + train[2]["rewards/exact_match/mean"], abs=1e-6)
    three = train[3]
    assert three["reward"] == pytest.approx(0.5 * three["rewards/vowel/mean"] + three["rewards/early/mean"]
                                            + three["rewards/exact_match/mean"], abs=1e-6)
    assert [k for k in train[4] if k.endswith("/mean") and k.startswith("rewards/")] == ["rewards/vowel/mean"]
    assert train[4]["reward"] == pytest.approx(0.5 * train[4]["rewards/vowel/mean"], abs=1e-6)
    folder = tmp_path / "a"
    sets = [e for e in read_events(folder / "events.jsonl") if e["type"] == "set"]
    assert [sorted(e["changes"]) for e in sets] == [["grpo_temperature", "reward_weights"], ["rewards"], ["rewards"],
                                                   ["rewards"]]
    assert [e["name"] for e in sets[2]["before"]["rewards"]] == ["vowel", "exact_match", "early"]
    assert [(e["name"], e["weight"]) for e in sets[3]["changes"]["rewards"]] == [("vowel", 0.5)]
    assert sets[3]["applies_from_step"] == 4

    # resumed from the step-4 checkpoint: the weights, temperature and rewards come back with it
    again, seen_again, _ = _train(inputs, tmp_path, "run_name=b", *GRPO, f"resume={folder}/checkpoints/step-4")
    assert sorted(again) == [5, 6] and seen_again[5] == 0.7
    assert seen["weights-5"] != seen["weights-4"]  # it trains
    for step in (5, 6):
        assert _trained(again[step]) == _trained(train[step]), step
        assert seen_again[f"weights-{step}"] == seen[f"weights-{step}"], step
        assert [k for k in again[step] if k.startswith("rewards/")] == ["rewards/vowel/mean", "rewards/vowel/std"]


def _trained(record: dict) -> dict:
    """What a step trained and scored (its times and memory aside: they are the machine's)."""
    return {k: v for k, v in record.items() if k == "loss" or k.startswith(("reward", "completions/", "clip_ratio/",
                                                                            "frac_", "grad_norm", "lr"))}


@pytest.mark.slow  # a step of SFT
def test_a_run_that_is_not_grpo_refuses_them_naming_the_field(inputs, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": json.loads(l)["prompt"], "output": json.loads(l)["answer"]}) + "\n"
                            for l in (inputs / "prompts.jsonl").read_text().splitlines()))
    commands = {1: [Set(grpo_temperature=0.5), Set(reward_weights={"a": 1.0}), AddReward(reward={"kind": "regex",
                    "pattern": "a"}), RemoveReward(reward="a")]}
    _, _, replies = _train(inputs, tmp_path, "run_name=sft", f"data.train={data}", commands=commands, steps=2)
    assert "set: grpo_temperature needs a GRPO run (preference.objective grpo)" in replies["1-0"]["message"]
    assert "set: reward_weights needs a GRPO run" in replies["1-1"]["message"]
    assert "add_reward: needs a GRPO run" in replies["1-2"]["message"]
    assert "remove_reward: needs a GRPO run" in replies["1-3"]["message"]


@pytest.mark.slow  # four short GRPO steps
def test_under_num_iterations_a_sampling_setting_waits_for_the_step_that_samples(inputs, tmp_path):
    commands = {1: [Set(grpo_temperature=0.5), Set(grpo_top_p=0.9)], 2: [Set(grpo_temperature=0.5)]}
    train, seen, replies = _train(inputs, tmp_path, "run_name=mu", *GRPO, "grpo.num_iterations=2", steps=4,
                                  commands=commands)
    assert ("set: grpo_temperature: with grpo.num_iterations 2 the next step trains the samples of step 1 again"
            in replies["1-0"]["message"]) and "send it after step 2" in replies["1-0"]["message"]
    assert replies["1-1"]["result"]["changes"] == {"grpo_top_p": 0.9}  # sampling only: from the next sample
    assert replies["2-0"]["result"]["changes"] == {"grpo_temperature": 0.5}
    assert [seen[s] for s in (1, 2, 3, 4)] == [1.0, 1.0, 0.5, 0.5]
