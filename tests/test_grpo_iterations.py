"""grpo.num_iterations > 1 (docs/rewards.md): each optimizer step is a step, answers are sampled
every num_iterations steps and trained again with importance ratios in between; the sampler deals
each step's prompts num_iterations times; a run resumed from a checkpoint taken between the
iterations of one batch of samples repeats the uninterrupted run bit for bit (the samples travel
in the checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.callbacks import Callback
from engine.data.repeat_sampler import RepeatedBatchSampler

STEPS = 5
REWARDS = '''
def vowels(prompts, completions, **kwargs):
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]
'''


def test_the_repeat_sampler_deals_each_step_num_iterations_times():
    plain = RepeatedBatchSampler(12, 2, dp_rank=1, dp_size=2, seed=3, block=2, repeat=1)
    twice = RepeatedBatchSampler(12, 2, dp_rank=1, dp_size=2, seed=3, block=2, repeat=3)
    once = list(plain)  # 3 batches per rank: one step of 2, the incomplete last one left out
    assert len(once) == plain.num_batches == 2 and twice.num_batches == 6
    assert list(twice) == [*once, *once, *once]
    twice.set_start_batch(4)  # a resume inside the last run of repeats
    assert list(twice) == once
    assert twice.state_dict()["repeat"] == 3  # the data order's identity: a resume with another is refused


class Record(Callback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, loss):
        batch = trainer.train_fn.batch
        self.steps.append({"loss": loss, **trainer.train_fn.metrics, "sampled_at": batch.step,
                           "prompts": [i for s in batch.samples for i in s.indices]})


def _config(work: Path, out: Path, *extra: str):
    from contract.config.load import load_config
    return load_config(overrides=[
        f"model.path={work / 'model'}", f"data.train={work / 'prompts.jsonl'}", "objective=grpo",
        "grpo.num_iterations=2", "grpo.num_generations=4", "grpo.max_completion_length=4", "grpo.epsilon=0.02",
        "grpo.loss_type=grpo", f"grpo.rewards=[{{function: '{work}/my_rewards.py:vowels'}}]",
        f"max_steps={STEPS}", "batch_size=2", "train.grad_accum=2", "lr=2e-2", "optim.scheduler=constant",
        "precision=fp32", "checkpoint.save_at_end=false", "control.enabled=false", "logging.tensorboard=false",
        f"output_dir={out}", "run_name=run", *extra])


@pytest.mark.slow  # two single-rank runs of a tiny model
def test_samples_are_reused_and_a_resume_between_iterations_repeats_the_run(tmp_path):
    from conftest import save_tiny_llama
    from engine.data.default_task import make_examples, prompt_row
    from engine.trainer import Trainer
    save_tiny_llama(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(prompt_row(r)) + "\n"
                                                    for r in make_examples(24, seed=1)))
    (tmp_path / "my_rewards.py").write_text(REWARDS)

    full = Record()
    trainer = Trainer(config=_config(tmp_path, tmp_path, "checkpoint.every_n_steps=3"), callbacks=[full])
    trainer.train()
    folder = trainer.folder
    trainer.close()
    steps = full.steps
    assert [s["sampled_at"] for s in steps] == [0, 0, 2, 2, 4]  # TRL's steps: sampled every 2
    assert steps[0]["prompts"] == steps[1]["prompts"] != steps[2]["prompts"] == steps[3]["prompts"]
    assert [("reward" in s) for s in steps] == [True, False, True, False, True]  # logged when sampled
    assert steps[0]["clip_ratio/region_mean"] == 0.0  # the first iteration: ratio 1
    assert steps[1]["clip_ratio/region_mean"] > 0  # the second: the policy moved, ratios clip
    assert steps[1]["loss"] != steps[0]["loss"]

    resumed_steps = Record()  # step-3 stands between the two iterations of the samples of step 2
    resumed = Trainer(config=_config(tmp_path, tmp_path), run_dir=str(folder.root), callbacks=[resumed_steps])
    resumed.load_checkpoint(str(folder.checkpoints / "step-3"))
    resumed.train()
    resumed.close()
    assert resumed_steps.steps == steps[3:]  # bit for bit: losses, metrics, samples
