"""A run's event log turned into plot series, for every front end (notebook widgets, web app).

    history = RunHistory()
    history.update(read_events(folder.events))    # the whole past at once (a reattach) ...
    history.update(tail.poll())                   # ... then each new batch of lines
    history.train["loss"]      -> [(step, value), ...]
    history.eval["exact_match"] -> [(step, value), ...]    (the `eval/` prefix dropped)
    history.summary.state, history.eta()
    preference_panels(history.train, history.eval)   # a preference run's TRL metrics, by panel

The latest state, step and metrics come from `supervisor.summary.RunSummary` (the run manager's
own fold), so every view agrees on them; this module adds the history behind them. Torch-free.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from contract.events import (CommandEvent, CommandStatus, EvalEvent, Event, SamplesEvent, SetEvent, TrainEvent,
                             as_event, metric_numbers)
from contract.protocol.states import RunState
from supervisor.summary import RunSummary

Point = tuple[int, float]

# how many of the latest train records the speed (and so the ETA) is measured over
_ETA_WINDOW = 20


@dataclass
class RunHistory:
    """Every metric of a run over its steps, folded from its events in order."""
    summary: RunSummary = field(default_factory=RunSummary)
    train: dict[str, list[Point]] = field(default_factory=dict)
    eval: dict[str, list[Point]] = field(default_factory=dict)
    settings: list[dict] = field(default_factory=list)   # each `set` event: step and changes
    commands: list[CommandEvent] = field(default_factory=list)  # each command's final event
    samples: SamplesEvent | None = None                  # a GRPO run's latest `samples` event (app.samples)
    _times: list[tuple[int, float]] = field(default_factory=list)  # (step, time) of train records
    version: int = 0                                     # grows with every event folded in

    def update(self, events: Iterable[Event | dict[str, Any]]) -> int:
        """Fold new events in (in log order: models, or read JSON objects, each parsed once and
        skipped when it does not match its model); returns how many there were."""
        raw = list(events)
        parsed = [e for e in map(as_event, raw) if e is not None]
        self.summary.update(parsed)
        for event in parsed:
            if isinstance(event, TrainEvent):
                self._on_train(event)
            elif isinstance(event, EvalEvent):
                self._on_eval(event)
            elif isinstance(event, SetEvent):
                self.settings.append({"step": event.step, **(event.changes or {})})
            elif isinstance(event, CommandEvent) and event.status in (CommandStatus.DONE, CommandStatus.FAILED):
                self.commands.append(event)
            elif isinstance(event, SamplesEvent):
                self.samples = event
        self.version += len(raw)
        return len(raw)

    def _on_train(self, event: TrainEvent) -> None:
        step = event.step
        if step is None:
            return
        _cut_from(self.train, step)
        train = self.train
        for key, value in metric_numbers(event).items():
            (train[key] if key in train else train.setdefault(key, [])).append((step, float(value)))
        self._times = [t for t in self._times if t[0] < step]
        if event.time is not None:
            self._times.append((step, float(event.time)))
            del self._times[:-_ETA_WINDOW]

    def _on_eval(self, event: EvalEvent) -> None:
        step = event.step
        if step is None:
            return
        _cut_from(self.eval, step)
        for key, value in metric_numbers(event).items():
            self.eval.setdefault(key[len("eval/"):], []).append((step, float(value)))

    # -- reading -----------------------------------------------------------------------------
    def values(self, name: str, split: str = "train") -> list[float]:
        """The values of one series (train or eval), in step order."""
        return [v for _, v in (self.train if split == "train" else self.eval).get(name, [])]

    def latest(self, name: str, split: str = "train") -> float | None:
        values = self.values(name, split)
        return values[-1] if values else None

    def seconds_per_step(self) -> float | None:
        """Wall time per step over the latest records (pauses count, so it is honest about ETA)."""
        if len(self._times) < 2:
            return None
        (s0, t0), (s1, t1) = self._times[0], self._times[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left until the last step, from the recent speed; None when not known."""
        s = self.summary
        per_step = self.seconds_per_step()
        if per_step is None or not s.total_steps or s.final or s.state == RunState.PAUSED:
            return None
        left = max(0, s.total_steps - s.step) * per_step
        if self._times:  # time already spent on the step under way
            left -= max(0.0, (now or time.time()) - self._times[-1][1])
        return max(0.0, left)


# TRL's preference metrics, as the engine logs them every step (and at each evaluation under
# `eval/`), grouped into panels: (panel title, [(split, metric, line label), ...]). An SFT run logs
# none of them, so it gets no panel.
PREFERENCE_PANELS: tuple[tuple[str, tuple[tuple[str, str, str], ...]], ...] = (
    ("rewards", (("train", "rewards/chosen", "chosen"), ("train", "rewards/rejected", "rejected"))),
    ("reward accuracy", (("train", "rewards/accuracies", "train"), ("eval", "rewards/accuracies", "eval"))),
    ("reward margin", (("train", "rewards/margins", "train"), ("eval", "rewards/margins", "eval"))),
    ("log-probability", (("train", "logps/chosen", "chosen"), ("train", "logps/rejected", "rejected"))),
    ("kl (KTO)", (("train", "kl", "train"),)),
    ("nll loss (ORPO)", (("train", "nll_loss", "train"),)),
    ("log odds ratio (ORPO)", (("train", "log_odds_ratio", "train"),)),
    ("log odds chosen (ORPO)", (("train", "log_odds_chosen", "train"),)),
)


def preference_panels(train: dict[str, list[Point]], evals: dict[str, list[Point]]
                      ) -> list[tuple[str, list[tuple[str, list[Point]]]]]:
    """The preference panels that have points: [(title, [(line label, points), ...]), ...], in
    PREFERENCE_PANELS' order, non-finite values left out; empty for a run without them (SFT)."""
    out = []
    for title, lines in PREFERENCE_PANELS:
        drawn = [(label, finite) for split, metric, label in lines
                 if (finite := [(s, v) for s, v in (train if split == "train" else evals).get(metric, [])
                                if math.isfinite(v)])]
        if drawn:
            out.append((title, drawn))
    return out


def preference_series(train: dict[str, list[Point]], evals: dict[str, list[Point]]) -> dict[str, list[Point]]:
    """The preference panels as flat series named "panel · line" (the web plot's grouping)."""
    return {f"{title} · {label}": points for title, lines in preference_panels(train, evals)
            for label, points in lines}


def format_seconds(seconds: float | None) -> str:
    """`1:02:03`, `4:05`, or `-` when unknown."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _cut_from(series: dict[str, list[Point]], step: int) -> None:
    """Drop the points at `step` and after: a run resumed from an earlier checkpoint in its own
    folder trains those steps again, and its new records replace the old ones."""
    for points in series.values():
        while points and points[-1][0] >= step:
            points.pop()

