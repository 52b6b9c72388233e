"""A GRPO run's samples on screen and a person's ratings (engine.objectives.grpo_samples,
docs/rewards.md "Samples and ratings"): the `samples` event's model, the rating's reward and
advantage (TRL's NaN-aware total and advantages over the rated group with a `human` reward), and
one short real run (one rank in this process, a tiny Llama) where the samples arrive each step, a
rating is answered only once it is in the inbox, the next step trains the rated group with
`rewards/human/mean`, a forgotten rating trains nothing, a resume from the checkpoint before the
rating replays it bit for bit. The front ends' tables and ratings: tests/test_samples_front.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from contract import inbox as inbox_file
from contract.events import EventError, SamplesEvent, check_event, parse_event
from contract.protocol.base import ProtocolError
from contract.protocol.commands import command_from_wire
from contract.run_folder import read_events


def _row(number: int, **extra) -> dict:
    return {"number": number, "group": number // 2, "row": 3, "prompt": "2+2=", "completion": "4",
            "rewards": {"exact": 1.0, "vowel": None}, "total": 1.0, "advantage": 0.5, "clipped": False, **extra}


def test_the_samples_event_is_a_model_read_back_alike():
    event = SamplesEvent(step=3, samples=[_row(0), _row(1)], count=2, text_limit=300)
    record = check_event(event)
    assert record["type"] == "samples" and record["samples"][1]["rewards"] == {"exact": 1.0, "vowel": None}
    back = parse_event(json.loads(json.dumps(record)))
    assert isinstance(back, SamplesEvent) and back.samples[0].advantage == 0.5
    with pytest.raises(EventError, match="samples"):
        check_event({"type": "samples", "step": 1, "samples": [{"number": 0}]})


def test_the_rate_command_takes_up_down_or_a_score():
    assert command_from_wire("rate", {"step": 2, "sample": 5, "score": "up"}).score == 1.0
    assert command_from_wire("rate", {"step": 2, "sample": 5, "score": "down"}).score == -1.0
    for args, words in (({"step": 2, "sample": 5, "score": 1.5}, "'score' must be at least -1.0 and at most 1.0"),
                        ({"step": 0, "sample": 0, "score": 1}, "'step' must be at least 1"),
                        ({"step": 1, "sample": -1, "score": 1}, "'sample' must be at least 0")):
        with pytest.raises(ProtocolError, match=words):
            command_from_wire("rate", args)


def test_a_rated_group_gets_the_human_reward_and_trl_advantages():
    from engine.objectives.grpo import advantages_of
    from engine.objectives.grpo_samples import Rating, Ratings
    from engine.objectives.rewards import metrics_of, total

    class Trainer:  # what take() reads: the step, for a warning
        state = type("S", (), {"global_step": 4})()
        emitted: list = []

        def emit(self, event):
            self.emitted.append(event)

    ratings = Ratings()
    # a group of 3 whose exact-match rewards are all 0 and one function (added since) never scored it
    ratings.pending = [Rating("t1", [5, 6], [[7], [8, 9], [10]], {"exact": [0.0, 0.0, 0.0]}, rated=1, score=1.0),
                       Rating("t2", [5], [[7], [8]], {"exact": [0.0, 1.0]}, rated=0, score=-1.0)]  # another size
    step_rewards = torch.tensor([[1.0, 0.0], [0.0, float("nan")], [0.0, 0.0]])  # the step's own group
    rated = ratings.take(Trainer(), ["exact", "new"], [1.0, 0.5], step_rewards, num_generations=3)
    assert rated.names == ["exact", "new", "human"] and rated.weights == [1.0, 0.5, 1.0]
    assert ratings.pending == [] and [g.id for g in rated.groups] == ["t1"] and "t2" in Trainer.emitted[0].message
    assert rated.tokens == 4.0
    nan = float("nan")
    expected = torch.tensor([[1.0, 0.0, nan], [0.0, nan, nan], [0.0, 0.0, nan],
                             [0.0, nan, nan], [0.0, nan, 1.0], [0.0, nan, nan]])
    assert torch.equal(torch.isnan(rated.rewards), torch.isnan(expected))
    assert torch.equal(torch.nan_to_num(rated.rewards), torch.nan_to_num(expected))
    totals = total(rated.rewards, rated.weights)
    assert totals[3:].tolist() == [0.0, 1.0, 0.0]  # the rated answer: its functions' total plus the rating
    advantages, _ = advantages_of(totals, 3, "group")
    # TRL's: (r - mean) / (std + 1e-4), std Bessel-corrected: mean 1/3, std sqrt(1/3)
    std = (1 / 3) ** 0.5
    assert advantages[3:].tolist() == pytest.approx([-1 / 3 / (std + 1e-4), 2 / 3 / (std + 1e-4), -1 / 3 / (std + 1e-4)])
    metrics = metrics_of(rated.names, rated.rewards, rated.weights, torch.zeros(6, dtype=torch.bool))
    assert metrics["rewards/human/mean"] == 1.0 and "rewards/human/std" not in metrics  # one rating: no std


def test_ratings_replay_by_step_and_a_forgotten_one_does_not(tmp_path):
    from engine.objectives.grpo_samples import Ratings
    path = inbox_file.inbox_path(tmp_path)
    group = {"prompt_ids": [1], "completion_ids": [[2], [3]], "rewards": {"exact": [0.0, 1.0]}, "rated": 0}
    for entry_id, step in (("t1", 4), ("t2", 5), ("t3", 5), ("t4", 5)):
        inbox_file.add_rating(path, entry_id, step, {**group, "score": 1.0})
    inbox_file.forget_entry(path, "t3", 5)   # forgotten at the boundary it was given: never trained
    inbox_file.forget_entry(path, "t4", 7)   # forgotten after it trained: a replay still trains it
    assert [e.id for e in inbox_file.read_inbox(path)] == []  # ratings are no taught answers
    ratings = Ratings()
    ratings.on_load_checkpoint(None, {"step": 5, "inbox": str(path)})
    assert [r.id for r in ratings.pending] == ["t2", "t4"]
    assert inbox_file.next_id(path) == "t5"


# -- one real run --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Three GRPO steps (checkpoint each step) with ratings sent after steps 1 and 2, then a resume
    from step 1's checkpoint (taken before step 1's ratings) for steps 2 and 3."""
    from conftest import save_tiny_llama
    from contract.config.load import load_config
    from contract.protocol.data_commands import Forget
    from contract.protocol.rating_commands import Rate
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.data import default_task
    from engine.trainer import Trainer

    work = tmp_path_factory.mktemp("grpo-samples")
    save_tiny_llama(work / "model")
    rows = [{"prompt": r["input"], "answer": r["output"]} for r in default_task.make_examples(32, 5)]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    replies: dict[str, dict] = {}

    def train(name: str, commands: dict, *extra: str) -> Path:
        class Send(Callback):
            def on_train_batch_end(self, trainer, loss):
                step = trainer.state.global_step
                for i, cmd in enumerate(commands.get(step, [])):
                    key = f"{name}-{step}-{i}"

                    def answered(frame: dict, key=key) -> None:  # what the inbox holds when answered
                        replies[key] = {**frame, "inbox": inbox_file.read_ratings(trainer.folder.root / "inbox.jsonl")}
                    trainer.control.commands.put(key, cmd, Reply(key, answered, cmd.returns))

        cfg = load_config(overrides=[
            f"output_dir={work}", f"run_name={name}", "max_steps=3", "batch_size=2", "precision=fp32",
            "train.seed=3", f"model.path={work / 'model'}", f"data.train={work / 'prompts.jsonl'}",
            "data.max_length=40", "eval.every_n_steps=0", "logging.tensorboard=false", "lr=5e-3",
            "optim.scheduler=constant", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0",
            "checkpoint.save_at_end=false",
            "control.enabled=true", "objective=grpo", "grpo.num_generations=4", "grpo.max_completion_length=4",
            "grpo.loss_type=grpo", "grpo.rewards=[{kind: exact_match, column: answer}]", *extra])
        trainer = Trainer(config=cfg, callbacks=[Send()])
        trainer.train()
        trainer.close()
        return work / name

    commands = {1: [Rate(step=1, sample=5, score="up"), Rate(step=9, sample=0, score=1.0),
                    Rate(step=1, sample=999, score=1.0)],
                2: [Rate(step=2, sample=0, score=-0.5), Forget(id="t2")]}
    first = train("a", commands)
    again = train("b", {}, f"resume={first}/checkpoints/step-1")
    return {"first": first, "again": again, "replies": replies}


def _events(folder: Path, kind: str) -> list[dict]:
    return [e for e in read_events(folder / "events.jsonl") if e["type"] == kind]


@pytest.mark.slow  # two short GRPO runs of a tiny Llama, one rank in this process (~25 s)
def test_samples_arrive_each_step_with_their_scores(run):
    samples = _events(run["first"], "samples")
    assert [e["step"] for e in samples] == [1, 2, 3]
    first = SamplesEvent.model_validate(samples[0])
    assert first.count == 8 and len(first.samples) == 8 and first.text_limit == 300
    assert [(s.number, s.group) for s in first.samples] == [(i, i // 4) for i in range(8)]
    for s in first.samples:
        assert set(s.rewards) == {"exact_match"} and s.total == s.rewards["exact_match"]
        assert s.row is not None and s.row >= 1 and s.prompt and "<" not in s.prompt  # no special tokens
        assert isinstance(s.clipped, bool) and len(s.completion) <= 300
    group = [s.advantage for s in first.samples[:4]]
    assert sum(group) == pytest.approx(0.0, abs=1e-5)


@pytest.mark.slow
def test_a_rating_is_answered_once_in_the_inbox_and_trains_the_next_step(run):
    replies = run["replies"]
    done = replies["a-1-0"]
    assert done["type"] == "done", done
    answer = done["result"]
    assert answer["id"] == "t1" and answer["group"] == 1 and answer["applies_from_step"] == 2
    stored = [r for r in done["inbox"] if r["id"] == "t1"]  # in the file when the answer was sent
    assert stored and stored[0]["score"] == 1.0 and stored[0]["rated"] == 1 and len(stored[0]["completion_ids"]) == 4
    assert stored[0]["step"] == 1 and set(stored[0]["rewards"]) == {"exact_match"}
    assert "the samples of step 9 are not held" in replies["a-1-1"]["message"]
    assert "step 1 has samples 0 to 7, not 999" in replies["a-1-2"]["message"]
    train = {e["step"]: e for e in _events(run["first"], "train")}
    assert "rewards/human/mean" not in train[1]
    assert train[2]["rewards/human/mean"] == 1.0
    # step 2's rating (t2) was forgotten at the same boundary: step 3 trains no rated group
    assert replies["a-2-1"]["type"] == "done" and replies["a-2-1"]["result"]["id"] == "t2"
    assert "rewards/human/mean" not in train[3]
    assert [r["forgotten_at"] for r in inbox_file.read_ratings(run["first"] / "inbox.jsonl")] == [None, 2]


@pytest.mark.slow
def test_a_resume_from_before_the_rating_replays_it(run):
    first = {e["step"]: e for e in _events(run["first"], "train")}
    again = {e["step"]: e for e in _events(run["again"], "train")}
    assert sorted(again) == [2, 3]
    for step in (2, 3):
        assert again[step]["loss"] == first[step]["loss"], step
        assert {k: v for k, v in again[step].items() if k.startswith("reward")} == \
            {k: v for k, v in first[step].items() if k.startswith("reward")}, step
