"""Evaluators: called by the trainer on every rank (collective), each returns named metrics.

Each evaluator sees its rank's share of the evaluation data and sums its counts over the
data-parallel group, so every rank returns the same numbers.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine.config import RunConfig
from engine.generation import generate


def _all_sum(values: list[float], trainer) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if trainer.env.world_size > 1:
        dist.all_reduce(t, group=trainer.env.dp_group)
    return t.tolist()


class Perplexity:
    """Token-weighted mean loss over the evaluation set, and its exponential."""

    name = "perplexity"

    def __call__(self, trainer) -> dict[str, float]:
        loss_sum, tokens = 0.0, 0
        for batch in trainer.eval_loader():
            n = int((batch["labels"][:, 1:] != -100).sum())
            if n == 0:
                continue
            loss = trainer.compute_loss(batch)
            loss_sum += float(loss) * n
            tokens += n
        loss_sum, tokens = _all_sum([loss_sum, tokens], trainer)
        mean = loss_sum / max(tokens, 1)
        return {"loss": mean, "perplexity": math.exp(min(mean, 50.0))}


class ExactMatch:
    """Greedy generation from each row's `input`, compared with its `output` (stripped)."""

    name = "exact_match"

    def __init__(self, max_new_tokens: int, batch_size: int, max_samples: int = 0):
        self.max_new_tokens, self.batch_size, self.max_samples = max_new_tokens, batch_size, max_samples

    def __call__(self, trainer) -> dict[str, float]:
        rows = trainer.eval_rows or []
        rows = [r for r in rows if "input" in r and "output" in r]
        if self.max_samples:
            rows = rows[: self.max_samples]
        if not rows:
            return {}
        env = trainer.env
        mine = rows[env.dp_rank::env.dp_size]
        # every rank runs the same number of batches: generation under ZeRO-3 is collective
        per_rank = math.ceil(len(rows) / env.dp_size)
        padded = mine + [mine[0] if mine else rows[0]] * (per_rank - len(mine))
        correct = 0
        for start in range(0, per_rank, self.batch_size):
            chunk = padded[start:start + self.batch_size]
            answers = generate(trainer, [r["input"] for r in chunk], max_new_tokens=self.max_new_tokens)
            for i, (row, answer) in enumerate(zip(chunk, answers)):
                if start + i < len(mine) and answer.strip() == str(row["output"]).strip():
                    correct += 1
        correct, total = _all_sum([correct, len(mine)], trainer)
        return {"exact_match": correct / max(total, 1)}


def from_config(cfg: RunConfig) -> list:
    built = []
    for name in cfg.eval.evaluators:
        if name == "perplexity":
            built.append(Perplexity())
        elif name == "exact_match":
            built.append(ExactMatch(cfg.eval.max_new_tokens, cfg.eval.batch_size, cfg.eval.max_samples))
    return built
