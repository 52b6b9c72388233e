"""Rating an answer the chat gave during a GRPO run (engine.objectives.grpo_chat, docs/rewards.md
"Rating a chat answer"): the group it makes (the rated answer and fresh samples, the `human`
reward the score for it and 0 for the fresh ones) gives it TRL's advantage against the group; and
one short real run (one rank in this process, a tiny Llama): a chat answer of the live weights is
rated, answered only once it is in the inbox (the ids as the chat produced them), trained at the
next step as one more group; an answer the live weights did not give is refused, a forgotten
rating trains nothing, a resume from the checkpoint before the rating replays it bit for bit, and
a run of another objective refuses `rate_chat`. Two ranks: tests/test_grpo_chat_rating_ranks.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from contract import inbox as inbox_file
from contract.protocol.base import ProtocolError
from contract.protocol.commands import command_from_wire
from contract.run_folder import read_events

NAN = float("nan")


def test_the_rate_chat_command_takes_a_prompt_or_a_chat_and_up_down_or_a_score():
    cmd = command_from_wire("rate_chat", {"prompt": "2+2=", "answer": "4", "score": "up"})
    assert cmd.score == 1.0 and cmd.step is None
    chat = command_from_wire("rate_chat", {"messages": [{"role": "user", "content": "hi"}], "answer": "yo",
                                           "score": "down", "step": 3})
    assert chat.score == -1.0 and chat.step == 3
    for args, words in (({"prompt": "a", "answer": "b", "score": 2}, "'score' must be at least -1.0 and at most 1.0"),
                        ({"answer": "b", "score": 1}, "give exactly one of `prompt` or `messages`")):
        with pytest.raises(ProtocolError, match=words):
            command_from_wire("rate_chat", args)


class _Trainer:  # what Ratings.take reads: the step, for a warning
    state = SimpleNamespace(global_step=4)

    def emit(self, event):
        raise AssertionError(f"no warning expected: {event}")


@pytest.mark.parametrize("score", [1.0, -1.0])
def test_a_rated_chat_answer_is_compared_with_fresh_samples_of_its_prompt(score):
    """No function can score a chat prompt (no answer column): the fresh samples' `human` 0 is
    the group's baseline, so the rated answer's advantage has the rating's sign and the group's
    advantages sum to 0 (with None for them, every advantage would be 0: nothing would train)."""
    from engine.objectives.grpo import advantages_of
    from engine.objectives.grpo_samples import Rating, Ratings
    from engine.objectives.rewards import total

    ratings = Ratings()
    rating = Rating("t1", [5, 6], [[7, 2]], {}, rated=0, score=score, chat=True, completion_text="x")
    ratings.pending = [rating.grouped([[7, 2], [8], [9, 9], [3]], {"exact_match": [None] * 4})]
    step_rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])  # the step's own group
    rated = ratings.take(_Trainer(), ["exact_match"], [1.0], step_rewards, num_generations=4)
    assert rated.names == ["exact_match", "human"] and rated.tokens == 6.0
    group = rated.rewards[4:]
    assert torch.isnan(group[:, 0]).all() and group[:, 1].tolist() == [score, 0.0, 0.0, 0.0]
    advantages, _ = advantages_of(total(rated.rewards, rated.weights), 4, "group")
    std = 0.5  # of (s, 0, 0, 0) with s = +-1, Bessel-corrected
    expected = [0.75 * score / (std + 1e-4)] + [-0.25 * score / (std + 1e-4)] * 3
    assert advantages[4:].tolist() == pytest.approx(expected)
    assert advantages[:4].tolist() == pytest.approx([x / ((1 / 3) ** 0.5 + 1e-4) for x in (0.5, -0.5, -0.5, 0.5)],
                                                    rel=1e-4)  # the step's own group: unchanged


def test_a_chat_group_s_functions_score_it_with_none_columns():
    """What a function gets for a chat group: the chat's prompt, every data column None."""
    from contract.rewards import build_reward
    from engine.objectives.grpo_chat import score_group
    from engine.objectives.grpo_samples import Rating

    rewards = [build_reward({"kind": "exact_match", "column": "answer"}, "r"),
               build_reward({"kind": "regex", "pattern": "o"}, "r")]
    trainer = SimpleNamespace(train_dataset=SimpleNamespace(columns=[{"answer": "4"}, {"answer": "5", "note": 1}]))
    rating = Rating("t1", [1], [[2]], {}, 0, 1.0, chat=True, chat_prompt=[{"role": "user", "content": "hi"}])
    values = score_group(trainer, rating, rewards, [[2], [3]], ["yo", "hey"])
    assert torch.isnan(values[:, 0]).all() and values[:, 1].tolist() == [1.0, 0.0]


def test_a_run_of_another_objective_refuses_rate_chat():
    from contract.protocol.rating_commands import RateChat
    from engine.control.handlers import CommandRefused, rate_chat

    control = SimpleNamespace(trainer=SimpleNamespace(train_fn=None, config=SimpleNamespace(
        control=SimpleNamespace(chat_only=False), preference=SimpleNamespace(objective="dpo"))))
    with pytest.raises(CommandRefused, match="only a GRPO run's chat answers can be rated .* this is a dpo run"):
        rate_chat(control, RateChat(prompt="a", answer="b", score=1), None)


# -- one real run --------------------------------------------------------------------------------------
PROMPTS = ("reverse: abc\n", "reverse: hello\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Four GRPO steps (checkpoint each step): the chat answers PROMPTS[0] at step 1's boundary
    and PROMPTS[1] at step 2's; step 2's boundary rates the first (up), step 3's rates the second
    (down) and forgets that rating at once; then a resume from step 2's checkpoint (taken before
    step 2's boundary) trains steps 3 and 4 again."""
    from conftest import save_tiny_llama
    from contract.config.load import load_config
    from contract.protocol.commands import Generate
    from contract.protocol.data_commands import Forget
    from contract.protocol.rating_commands import RateChat
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.data import default_task
    from engine.trainer import Trainer

    work = tmp_path_factory.mktemp("grpo-chat")
    save_tiny_llama(work / "model")
    rows = [{"prompt": r["input"], "answer": r["output"]} for r in default_task.make_examples(32, 5)]
    (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    replies: dict[str, dict] = {}

    def text(key: str) -> str:
        return replies[key]["result"]["text"]

    commands = {
        1: [lambda: Generate(prompt=PROMPTS[0], max_new_tokens=6, temperature=1.0, seed=11)],
        2: [lambda: RateChat(prompt=PROMPTS[0], answer=text("a-1-0"), score="up", step=1),
            lambda: RateChat(prompt=PROMPTS[0], answer=text("a-1-0") + "!", score="up"),  # not what it said
            lambda: RateChat(prompt=PROMPTS[1], answer=text("a-1-0"), score="up"),  # not to that prompt
            lambda: Generate(prompt=PROMPTS[1], max_new_tokens=6, temperature=1.0, seed=12)],
        3: [lambda: RateChat(prompt=PROMPTS[1], answer=text("a-2-3"), score="down"), lambda: Forget(id="t2")]}

    def train(name: str, commands: dict, *extra: str) -> Path:
        class Send(Callback):
            def on_train_batch_end(self, trainer, loss):
                step = trainer.state.global_step
                for i, make in enumerate(commands.get(step, [])):
                    key, cmd = f"{name}-{step}-{i}", make()

                    def answered(frame: dict, key=key) -> None:  # what the inbox holds when answered
                        replies[key] = {**frame, "inbox": inbox_file.read_ratings(trainer.folder.root / "inbox.jsonl")}
                    trainer.control.commands.put(key, cmd, Reply(key, answered, cmd.returns))

        cfg = load_config(overrides=[
            f"output_dir={work}", f"run_name={name}", "max_steps=4", "batch_size=2", "precision=fp32",
            "train.seed=3", f"model.path={work / 'model'}", f"data.train={work / 'prompts.jsonl'}",
            "data.max_length=40", "eval.every_n_steps=0", "logging.tensorboard=false", "lr=5e-3",
            "optim.scheduler=constant", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0",
            "checkpoint.save_at_end=false",
            "control.enabled=true", "objective=grpo", "grpo.num_generations=4", "grpo.max_completion_length=4",
            "grpo.loss_type=grpo", "grpo.rewards=[{kind: exact_match, column: answer}]", *extra])
        trainer = Trainer(config=cfg, callbacks=[Send()])
        trainer.train()
        tokenizer = trainer.tokenizer
        trainer.close()
        return work / name, tokenizer

    first, tokenizer = train("a", commands)
    again, _ = train("b", {}, f"resume={first}/checkpoints/step-2")
    return {"first": first, "again": again, "replies": replies, "tokenizer": tokenizer}


def _train(folder: Path) -> dict[int, dict]:
    return {e["step"]: e for e in read_events(folder / "events.jsonl") if e["type"] == "train"}


@pytest.mark.slow  # two short GRPO runs of a tiny Llama, one rank in this process
def test_a_chat_answer_is_rated_in_the_inbox_and_its_group_trains_the_next_step(run):
    replies = run["replies"]
    said = replies["a-1-0"]["result"]
    done = replies["a-2-0"]
    assert done["type"] == "done", done
    answer = done["result"]
    assert answer == {"step": 2, "id": "t1", "answer_step": 1, "score": 1.0, "group_size": 4, "applies_from_step": 3}
    stored = [r for r in done["inbox"] if r["id"] == "t1"]  # in the file when the answer was sent
    assert stored and stored[0]["chat"] is True and stored[0]["step"] == 2 and stored[0]["completion"] == said["text"]
    ids = stored[0]["completion_ids"]
    assert len(ids) == 1 and run["tokenizer"].decode(ids[0], skip_special_tokens=True) == said["text"]
    assert run["tokenizer"].decode(stored[0]["prompt_ids"]).endswith(PROMPTS[0])
    for key in ("a-2-1", "a-2-2"):  # an answer the live weights did not give to that prompt
        assert replies[key]["type"] == "error" and "gave no such answer to that prompt" in replies[key]["message"]
    train = _train(run["first"])
    assert "rewards/human/mean" not in train[2]
    assert train[3]["rewards/human/mean"] == 0.25  # the rating (1) and the 3 fresh samples' 0
    # step 3's rating (t2) was forgotten at the same boundary: step 4 trains no rated group
    assert replies["a-3-0"]["result"]["id"] == "t2" and replies["a-3-1"]["type"] == "done"
    assert "rewards/human/mean" not in train[4]
    assert [r["forgotten_at"] for r in inbox_file.read_ratings(run["first"] / "inbox.jsonl")] == [None, 3]


@pytest.mark.slow
def test_a_resume_from_before_the_chat_rating_replays_it_bit_for_bit(run):
    first, again = _train(run["first"]), _train(run["again"])
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        assert again[step]["loss"] == first[step]["loss"], step
        assert {k: v for k, v in again[step].items() if k.startswith(("reward", "completions", "frac"))} == \
            {k: v for k, v in first[step].items() if k.startswith(("reward", "completions", "frac"))}, step


def test_the_front_ends_read_the_last_answer_and_say_the_rating(tmp_path):
    """The web Chat tab rates its last finished answer with the messages it was sent with (the
    earlier turns only when the chat sends them); the words of the answer and of the picker."""
    from app.samples import rated_chat_text, ratings
    from app.web.chat_rate import last_answer
    from app.web.chat_turns import tagged
    from contract.protocol.rating_commands import RateChatAnswer

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": tagged("yo", 3, "live weights")},
            {"role": "user", "content": "reverse: abc"},
            {"role": "assistant", "content": [{"type": "text", "text": tagged("cba", 5, "live weights")}]}]
    assert last_answer(chat, False) == ([{"role": "user", "content": "reverse: abc"}], "cba", 5)
    assert last_answer(chat, True)[0] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                          {"role": "user", "content": "reverse: abc"}]
    assert last_answer(chat[:3] + [{"role": "assistant", "content": tagged("", 6, "x")}], False)[1:] == ("", 6)
    assert last_answer(chat[:3] + [{"role": "assistant", "content": "cb"}], False) is None  # still streaming
    assert last_answer(chat[:3] + [{"role": "assistant", "content": "⚠ the run could not answer"}], False) is None
    answer = RateChatAnswer(step=7, id="t4", answer_step=5, score=-1.0, group_size=4, applies_from_step=8)
    assert rated_chat_text(answer) == ("Rated the chat's answer of step 5 down (t4): at step 8 it trains with 3 fresh "
                                       "answers to the same question as a group, with a 'human' reward (the fresh "
                                       "ones 0). Forget t4 to take it back.")
    inbox_file.add_rating(inbox_file.inbox_path(tmp_path), "t4", 7, {
        "chat": True, "answer_step": 5, "score": -1.0, "rated": 0, "completion": "cba", "prompt_ids": [1],
        "completion_ids": [[2]], "rewards": {}})
    assert [g.label for g in ratings(tmp_path)] == ['t4: chat (step 5) down · "cba" (given at step 7)']


def test_a_resume_replays_the_ratings_still_pending_under_num_iterations(tmp_path):
    """With grpo.num_iterations 2 the steps between two sampling steps reuse the samples, so a
    rating given after a sampling step waits for the next one; a checkpoint taken in between
    replays it too (ratings given at steps 4, 5 and 6's boundaries; a step samples when a multiple
    of num_iterations steps are done, and takes the ratings given since the last one)."""
    from engine.objectives.grpo_samples import Ratings

    path = inbox_file.inbox_path(tmp_path)
    group = {"prompt_ids": [1], "completion_ids": [[2]], "rewards": {}, "rated": 0, "score": 1.0, "chat": True}
    for entry_id, step in (("t1", 4), ("t2", 5), ("t3", 6)):
        inbox_file.add_rating(path, entry_id, step, group)
    ratings = Ratings()
    for step, iterations, pending in ((5, 2, ["t2"]), (6, 2, ["t2", "t3"]), (4, 2, ["t1"]), (5, 1, ["t2"]),
                                      (6, 3, ["t1", "t2", "t3"]), (7, 3, [])):
        ratings.on_load_checkpoint(None, {"step": step, "inbox": str(path), "iterations": iterations})
        assert [r.id for r in ratings.pending] == pending, (step, iterations)
    ratings.on_load_checkpoint(None, {"step": 6, "inbox": str(path)})  # a checkpoint of before: 1 iteration
    assert [r.id for r in ratings.pending] == ["t3"]
