"""The embedded default's GRPO variant starts from the default task's SFT model (docs/rewards.md).

GRPO learns only from right answers it samples; a model of random weights almost never writes
one, so its mean reward would stay at 0. `./launch.sh train objective=grpo` (the embedded
default: no model, no data named) therefore first trains the default task with SFT for
`contract.presets.WARM_START_STEPS` steps in the same output folder (a run named `default-sft`,
followed like any run), then starts GRPO from its final model (`model.path`). The SFT run is
kept: the next GRPO run in that folder starts from it at once. `LIVETUNE_WARM_START_STEPS` sets
another number of SFT steps (the tests' quick end-to-end run).
"""

from __future__ import annotations

import os
from pathlib import Path

from contract.args import resolve_args
from contract.config.schema import RunConfig
from contract.events import StateEvent, parse_event
from contract.presets import WARM_START_STEPS
from contract.protocol.states import RunState
from contract.run_folder import read_events

NAME = "default-sft"
STEPS_ENV = "LIVETUNE_WARM_START_STEPS"


def wanted(cfg: RunConfig) -> bool:
    """Whether the run is the embedded default's GRPO variant with no model of its own."""
    return cfg.preference.objective == "grpo" and not cfg.model.path and cfg.uses_default_task


def ready(output_dir: str | Path) -> Path | None:
    """The final model of a finished `default-sft` run in `output_dir` (the newest), or None."""
    found = []
    for folder in Path(output_dir).glob(f"{NAME}*"):
        model = folder / "model"
        if (model / "config.json").is_file() and _finished(folder / "events.jsonl"):
            found.append(model)
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _finished(events: Path) -> bool:
    states = [e for e in map(parse_event, read_events(events)) if isinstance(e, StateEvent)]
    return bool(states) and states[-1].state == RunState.FINISHED


def steps() -> int:
    """The SFT run's steps: WARM_START_STEPS, or $LIVETUNE_WARM_START_STEPS."""
    return int(os.environ.get(STEPS_ENV) or WARM_START_STEPS)


def sft_config(cfg: RunConfig) -> RunConfig:
    """The SFT run that makes the starting model: the embedded default preset for `steps()`
    steps, its final model saved, in the GRPO run's output folder and precision."""
    return resolve_args([f"logging.output_dir={cfg.logging.output_dir}", f"logging.run_name={NAME}",
                         f"train.max_steps={steps()}", f"train.precision={cfg.train.precision}",
                         "checkpoint.save_at_end=true", "eval.at_end=true"]).config
