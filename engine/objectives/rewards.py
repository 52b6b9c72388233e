"""Scoring sampled answers with the run's reward functions (contract.rewards declares and checks
them): one column per function, None as NaN (that function does not score that sample), the
weighted NaN-aware sum (TRL's: a sample no function scored is NaN, counted in no mean).

A function that raises, or returns the wrong number of values or a non-number, is a
`RewardError` naming the function, the prompt (its index in the step's batch, 0-based, and its
data row) and the exception; the step then trains nothing and the run pauses
(engine.objectives.grpo_step)."""

from __future__ import annotations

import math
import traceback
from typing import Any, Sequence

import torch

from contract.rewards import Reward
from engine.objectives.grpo import nanstd


class RewardError(RuntimeError):
    """A reward function failed on a batch; `message` is what every front end shows."""

    def __init__(self, function: str, prompt_index: int, row: int | None, error: str, trace: str = ""):
        where = f"prompt {prompt_index}" + (f" (data row {row})" if row is not None else "")
        self.message = f"reward function {function!r} failed on {where}: {error}"
        self.trace = trace
        super().__init__(self.message)


def score(rewards: Sequence[Reward], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], num_generations: int, rows: list[int] | None = None) -> torch.Tensor:
    """(N, F) rewards of the N samples (each prompt's `num_generations` samples together) under
    the F functions, NaN where one did not score. `prompts`, `columns` hold one entry per sample."""
    out = torch.full((len(completions), len(rewards)), float("nan"), dtype=torch.float32)
    for j, reward in enumerate(rewards):
        try:
            values = reward.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            values = list(values)
        except Exception as e:
            index = _failing_prompt(reward, prompts, completions, completion_ids, columns, num_generations)
            raise RewardError(reward.name, index, _row(rows, index), f"{type(e).__name__}: {e}",
                              traceback.format_exc()) from e
        if len(values) != len(completions):
            raise RewardError(reward.name, 0, _row(rows, 0), f"returned {len(values)} values for "
                              f"{len(completions)} completions (one per completion, None to skip one)")
        for i, value in enumerate(values):
            if value is None:
                continue
            try:
                out[i, j] = float(value)
            except (TypeError, ValueError):
                raise RewardError(reward.name, i // num_generations, _row(rows, i // num_generations),
                                  f"returned {value!r}, not a number or None") from None
    return out


def total(per_function: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """The weighted sum over the functions, NaN where none scored the sample."""
    weighted = per_function * torch.tensor(list(weights), dtype=per_function.dtype).unsqueeze(0)
    summed = weighted.nansum(dim=1)
    summed[torch.isnan(per_function).all(dim=1)] = float("nan")
    return summed


def _failing_prompt(reward: Reward, prompts, completions, completion_ids, columns, num_generations: int) -> int:
    """The first prompt whose group makes the function raise on its own (0 when none does alone)."""
    for start in range(0, len(completions), num_generations):
        part = slice(start, start + num_generations)
        try:
            reward.fn(prompts=prompts[part], completions=completions[part], completion_ids=completion_ids[part],
                      **{k: v[part] for k, v in columns.items()})
        except Exception:
            return start // num_generations
    return 0


def _row(rows: list[int] | None, index: int) -> int | None:
    return rows[index] if rows is not None and 0 <= index < len(rows) else None


def metrics_of(names: Sequence[str], per_function: torch.Tensor, weights: Sequence[float],
               zero_std: torch.Tensor) -> dict[str, float]:
    """TRL's reward metrics of the step's samples (every rank's): rewards/<name>/mean and /std,
    reward, reward_std, frac_reward_zero_std (NaN-aware; a metric with no value is left out)."""
    out: dict[str, Any] = {}
    for j, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_function[:, j]).item()
        out[f"rewards/{name}/std"] = nanstd(per_function[:, j]).item()
    rewards = total(per_function, weights)
    out["reward"] = torch.nanmean(rewards).item()
    out["reward_std"] = nanstd(rewards).item()
    out["frac_reward_zero_std"] = zero_std.float().mean().item()
    return {k: float(v) for k, v in out.items() if not math.isnan(v)}
