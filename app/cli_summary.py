"""What the terminal says when a run has finished, after `finished: <folder>`: the steps it made,
its final metrics (the last step's loss and, on a preference or GRPO run, its rewards; the last
evaluation's metrics), and where the final model and the checkpoints are.

    steps: 30 of 30 (epoch 2)
    final: loss 0.1234  reward acc 75%  margin +0.420  (step 30)
    eval at step 30: eval loss 1.2000  eval exact_match 0.5
    final model: runs/cli/model (Hugging Face format)
    checkpoints: runs/cli/checkpoints (step-20, step-30)

Read from the run folder's event log alone (the history since the run's last start: a resumed
run's earlier life is not its outcome), so `watch` on a run started elsewhere says the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, TypeVar

from app.cli_live import eval_values, plain, train_values
from contract.events import (BestModelEvent, CheckpointDeletedEvent, CheckpointEvent, EvalEvent, Event, ExportEvent,
                             StateEvent, TrainEvent, as_event, metric_numbers)
from contract.protocol.states import RunState
from contract.run_folder import RunFolder, read_models

# the train values worth a line at the end (not the rate or the speed of the last step)
FINAL_KEYS = ("loss", "rewards/accuracies", "rewards/margins", "reward", "kl")

Raw = TypeVar("Raw", Event, dict[str, Any])


def since_last_start(events: Iterable[Raw]) -> list[Raw]:
    """The events of the run's last life: from its last `starting` state on (the events as given:
    models, or read JSON objects, which are told apart through their models)."""
    events = list(events)
    starts = [i for i, e in enumerate(events)
              if isinstance(m := as_event(e), StateEvent) and m.state == RunState.STARTING]
    return events[starts[-1]:] if starts else events


def end_summary(folder: RunFolder) -> list[str]:
    """The lines that sum up the finished run in `folder` (module docstring)."""
    try:
        events = since_last_start(read_models(folder.events))
    except OSError:
        return []
    return summary_lines(events, folder)


def summary_lines(events: Iterable[Event | dict[str, Any]], folder: RunFolder) -> list[str]:
    """The summary of `events` (one life of the run in `folder`; models, or read JSON objects:
    one that does not match its model is left out)."""
    parsed = [e for e in map(as_event, events) if e is not None]
    trains = [e for e in parsed if isinstance(e, TrainEvent)]
    evals = [e for e in parsed if isinstance(e, EvalEvent)]
    lines = []
    if trains:
        last = trains[-1]
        total = f" of {last.total_steps}" if last.total_steps else ""
        epoch = last.epoch if last.epoch is not None else "?"
        lines.append(f"steps: {last.step}{total} (epoch {epoch})")
        final = {k: v for k, v in train_values(metric_numbers(last)).items() if k in FINAL_KEYS}
        if final:
            lines.append(f"final: {plain(final.values())}  (step {last.step})")
    else:
        lines.append("steps: none trained")
    if evals and eval_values(metric_numbers(evals[-1])):
        lines.append(f"eval at step {evals[-1].step}: {plain(eval_values(metric_numbers(evals[-1])).values())}")
    lines += _saved(parsed, folder)
    return lines


def _saved(events: list[Event], folder: RunFolder) -> list[str]:
    """Where the final model (and adapter), the best model and the checkpoints kept are."""
    lines = []
    exports = {e.kind: e.path for e in events if isinstance(e, ExportEvent)}
    if exports.get("model"):
        lines.append(f"final model: {exports['model']} (Hugging Face format)")
    if exports.get("adapter"):
        lines.append(f"adapter: {exports['adapter']} (PEFT format)")
    if not exports:
        lines.append("final model: not saved (checkpoint.save_at_end=false, or stopped without a save)")
    best = [e for e in events if isinstance(e, BestModelEvent)]
    if best:
        lines.append(f"best model: step {best[-1].step} by {best[-1].monitor} "
                     f"= {best[-1].value} (loaded at the end)")
    kept: list[str] = []
    where = folder.checkpoints
    for e in events:
        if isinstance(e, CheckpointEvent) and e.path:
            path = _path(e.path)
            kept.append(path.name)
            where = path.parent  # a branch's checkpoints have their own folder
        elif isinstance(e, CheckpointDeletedEvent):
            gone = set(e.names or [])
            kept = [k for k in kept if k not in gone]
    kept = list(dict.fromkeys(kept))  # a name saved again (after a rewind) is listed once
    lines.append(f"checkpoints: {where} ({', '.join(kept)})" if kept else "checkpoints: none kept")
    return lines


def _path(where: str) -> Path:
    """A checkpoint's folder from its event's path (a file:// URL or a path)."""
    return Path(str(where).removeprefix("file://").rstrip("/"))
