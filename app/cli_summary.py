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
from typing import Iterable

from app.cli_live import eval_values, plain, train_values
from contract.events import EventType
from contract.protocol.states import RunState
from contract.run_folder import RunFolder, read_events

# the train values worth a line at the end (not the rate or the speed of the last step)
FINAL_KEYS = ("loss", "rewards/accuracies", "rewards/margins", "reward", "kl")


def since_last_start(events: Iterable[dict]) -> list[dict]:
    """The events of the run's last life: from its last `starting` state on."""
    events = list(events)
    starts = [i for i, e in enumerate(events)
              if e.get("type") == EventType.STATE and e.get("state") == RunState.STARTING]
    return events[starts[-1]:] if starts else events


def end_summary(folder: RunFolder) -> list[str]:
    """The lines that sum up the finished run in `folder` (module docstring)."""
    try:
        events = since_last_start(read_events(folder.events))
    except OSError:
        return []
    return summary_lines(events, folder)


def summary_lines(events: list[dict], folder: RunFolder) -> list[str]:
    """The summary of `events` (one life of the run in `folder`)."""
    trains = [e for e in events if e.get("type") == EventType.TRAIN]
    evals = [e for e in events if e.get("type") == EventType.EVAL]
    lines = []
    if trains:
        last = trains[-1]
        total = f" of {last['total_steps']}" if last.get("total_steps") else ""
        lines.append(f"steps: {last.get('step')}{total} (epoch {last.get('epoch', '?')})")
        final = {k: v for k, v in train_values(last).items() if k in FINAL_KEYS}
        if final:
            lines.append(f"final: {plain(final.values())}  (step {last.get('step')})")
    else:
        lines.append("steps: none trained")
    if evals and eval_values(evals[-1]):
        lines.append(f"eval at step {evals[-1].get('step')}: {plain(eval_values(evals[-1]).values())}")
    lines += _saved(events, folder)
    return lines


def _saved(events: list[dict], folder: RunFolder) -> list[str]:
    """Where the final model (and adapter), the best model and the checkpoints kept are."""
    lines = []
    exports = {e.get("kind"): e.get("path") for e in events if e.get("type") == EventType.EXPORT}
    if exports.get("model"):
        lines.append(f"final model: {exports['model']} (Hugging Face format)")
    if exports.get("adapter"):
        lines.append(f"adapter: {exports['adapter']} (PEFT format)")
    if not exports:
        lines.append("final model: not saved (checkpoint.save_at_end=false, or stopped without a save)")
    best = [e for e in events if e.get("type") == EventType.BEST_MODEL]
    if best:
        lines.append(f"best model: step {best[-1].get('step')} by {best[-1].get('monitor')} "
                     f"= {best[-1].get('value')} (loaded at the end)")
    kept: list[str] = []
    where = folder.checkpoints
    for e in events:
        if e.get("type") == EventType.CHECKPOINT and e.get("path"):
            path = _path(e["path"])
            kept.append(path.name)
            where = path.parent  # a branch's checkpoints have their own folder
        elif e.get("type") == EventType.CHECKPOINT_DELETED:
            gone = set(e.get("names") or [])
            kept = [k for k in kept if k not in gone]
    kept = list(dict.fromkeys(kept))  # a name saved again (after a rewind) is listed once
    lines.append(f"checkpoints: {where} ({', '.join(kept)})" if kept else "checkpoints: none kept")
    return lines


def _path(where: str) -> Path:
    """A checkpoint's folder from its event's path (a file:// URL or a path)."""
    return Path(str(where).removeprefix("file://").rstrip("/"))

