"""GRPO through the real entry point (a Trainer on the embedded default's prompt rows): the mean
reward of a user's reward function (`file.py:function`) rises; a reward function that raises
mid-run trains nothing that step and ends a run that has no control plane (a run with one
pauses) with a message naming the function, the prompt and the exception."""

import json

import pytest

pytestmark = pytest.mark.slow  # two single-rank runs of the default model: ~50 s and ~160 s on 2 loaded cores

REWARDS = '''
def vowels(prompts, completions, **kwargs):
    """The share of vowels in the answer: a reward a random model can climb."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


CALLS = []


def boom(prompts, completions, answer, **kwargs):
    CALLS.append(len(prompts))
    if len(CALLS) > 1:  # the first step is scored, the second fails
        raise ValueError("no sorting today")
    return [0.0] * len(completions)
'''


def _run(tmp_path, name: str, steps: int, rewards: str, extra=(), lr: float = 3e-3):
    from contract.config.load import load_config
    from engine.trainer import Trainer
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    cfg = load_config(None, ["objective=grpo", f"max_steps={steps}", "batch_size=2", "grpo.num_generations=4",
                             "grpo.max_completion_length=4", "grpo.loss_type=grpo", f"lr={lr}",
                             "optim.scheduler=constant", f"logging.output_dir={tmp_path}", f"run_name={name}",
                             "control.enabled=false", "logging.tensorboard=false",
                             "checkpoint.save_at_end=false", "precision=fp32",
                             f"grpo.rewards=[{rewards}]", *extra])
    with Trainer(config=cfg) as trainer:
        trainer.train()
    return [json.loads(line) for line in (tmp_path / name / "events.jsonl").read_text().splitlines()]


def test_mean_reward_rises_with_a_user_function(tmp_path):
    events = _run(tmp_path, "rises", 10, f"{{function: '{tmp_path}/my_rewards.py:vowels'}}", lr=6e-3)
    train = [e for e in events if e["type"] == "train"]
    assert len(train) == 10
    for key in ("reward", "reward_std", "rewards/vowels/mean", "rewards/vowels/std", "completions/mean_length",
                "completions/clipped_ratio", "frac_reward_zero_std", "clip_ratio/region_mean"):
        assert key in train[-1], key
    first = sum(e["reward"] for e in train[:3]) / 3
    last = sum(e["reward"] for e in train[-3:]) / 3
    print(f"mean reward, first 3 steps {first:.3f}, last 3 {last:.3f}")
    assert last > first + 0.05


def test_a_reward_function_that_raises_ends_the_step_untrained(tmp_path):
    events = _run(tmp_path, "raises", 4, f"{{function: '{tmp_path}/my_rewards.py:boom'}}")
    warnings = [e["message"] for e in events if e["type"] == "warning"]
    assert len(warnings) == 1, warnings
    message = warnings[0]
    assert "'boom'" in message and "ValueError: no sorting today" in message and "prompt " in message
    assert "data row" in message and "trained nothing" in message
    train = [e for e in events if e["type"] == "train"]
    assert [e["tokens"] > 0 for e in train] == [True, False]  # step 2 trained nothing; the run ended there
