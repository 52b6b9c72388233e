"""What the pages show of one run, folded from its events.jsonl as it grows.

The event log is the durable record, so a page opened (or reloaded) at any time rebuilds the
same plots from it: `RunView.poll()` reads only the lines added since the last poll, and
`frames()` turns what was read into the tables the plots draw. The fold itself is
`app.series.RunHistory`, the same one the notebook widgets use.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import pandas as pd

from app.series import PREFERENCE_PANELS, RunHistory, preference_series
from contract.protocol.states import RunState
from contract.run_folder import EventTail, RunFolder, tail_lines
from contract.events import EventType

# the most points a series sends to the browser; longer runs are thinned evenly (last kept)
MAX_POINTS = 400
# eval metrics that are plotted with the loss, not with the other evaluation metrics
LOSS_LIKE = ("loss", "perplexity")
# the objective's metrics, drawn in its own plot, evaluation included (its panels' "eval" lines, and
# "eval chosen" / "eval rejected" beside the train lines of the others): not again among the
# evaluation metrics
IN_REWARDS = frozenset(metric for _, lines in PREFERENCE_PANELS for _, metric, _ in lines)
GRPO_REWARD = (("reward", "mean reward (GRPO)"),)  # a GRPO run's reward per step, a panel of the objective's plot
Series = list[tuple[int, float]]


@dataclass(frozen=True)
class Progress:
    """A run's position, as the status line shows it."""
    state: str
    step: int
    total: int | None
    epoch: int
    eta_s: float | None
    elapsed_s: float | None
    last: dict[str, float]        # the latest train record's numbers
    last_eval: dict[str, float]   # the latest evaluation's numbers
    method: str | None

    @property
    def fraction(self) -> float:
        return min(1.0, self.step / self.total) if self.total else 0.0


class RunView:
    """One run's history (app.series.RunHistory, the fold every front end shares) and the tables
    the plots draw from it; thread-safe (several pages may show the same run)."""

    def __init__(self, folder: RunFolder):
        self.folder = folder
        self._tail = EventTail(folder.events)
        self._lock = threading.Lock()
        self.history = RunHistory()
        self.version = 0  # goes up whenever something new was read
        self.last_line_read_at = 0.0

    def poll(self) -> int:
        """Read what was appended since the last poll; returns the view's version."""
        with self._lock:
            if self.history.update(self._tail.poll_events()):
                self.version += 1
                self.last_line_read_at = time.time()
            return self.version

    @property
    def method(self) -> str | None:
        return self.history.summary.method

    # -- series for the plots ---------------------------------------------------------------------
    def series(self) -> dict[str, dict[str, Series]]:
        """Each plot's series, whole (app.web.plots sends a page only what it lacks): loss (raw,
        eval), eval (the other evaluation metrics, each its own), lr, tokens, memory, rewards (the
        preference metrics as "panel · line", app.series.preference_series)."""
        with self._lock:
            train = {name: list(points) for name, points in self.history.train.items()}
            evals = {name: list(points) for name, points in self.history.eval.items()}
        def pick(points: list) -> Series:
            return [(step, float(v)) for step, v in points if _number(v) and math.isfinite(v)]
        loss = {"raw": pick(train.get("loss", [])), "eval": pick(evals.get("loss", []))}
        return {
            "loss": {k: v for k, v in loss.items() if v},
            "eval": {name: pick(evals[name]) for name in sorted(evals) if name not in (*LOSS_LIKE, *IN_REWARDS)},
            "lr": {"lr": pick(train["lr"])} if "lr" in train else {},
            "tokens": {"tokens/s": pick(train["tokens_per_s"])} if "tokens_per_s" in train else {},
            "memory": {"rank 0": pick(train["mem_mb"])} if "mem_mb" in train else {},
            "rewards": {**{f"{title} · train": pick(train[key]) for key, title in GRPO_REWARD if key in train},
                        **preference_series(train, evals), **_eval_lines(evals, pick)},  # none for SFT
        }

    # -- tables for the plots ---------------------------------------------------------------------
    def frames(self, smoothing: float = 0.9) -> dict[str, pd.DataFrame]:
        """loss (raw, smoothed, eval), eval (other metrics), lr, tokens, memory."""
        with self._lock:
            train = {name: list(points) for name, points in self.history.train.items()}
            evals = {name: list(points) for name, points in self.history.eval.items()}
        loss = train.get("loss", [])
        smoothed = list(zip([s for s, _ in loss], _smooth([v for _, v in loss], smoothing)))
        loss_rows = _series(loss, "raw") + _series(smoothed, "smoothed") + _series(evals.get("loss", []), "eval")
        eval_rows = [row for name in sorted(evals) if name not in LOSS_LIKE
                     for row in _series(evals[name], name)]
        return {
            "loss": _frame(loss_rows, "loss"),
            "eval": _frame(eval_rows, "value"),
            "lr": _frame(_series(train.get("lr", []), "lr"), "lr"),
            "tokens": _frame(_series(train.get("tokens_per_s", []), "tokens/s"), "tokens_per_s"),
            "memory": _frame(_series(train.get("mem_mb", []), "rank 0"), "mem_mb"),
        }

    def eval_points(self, name: str) -> Series:
        """One evaluation metric's (step, value) points so far (the `eval/` prefix dropped)."""
        with self._lock:
            return list(self.history.eval.get(name, []))

    def progress(self, state: str | None = None) -> Progress:
        """Where the run is; `state` (from the run manager, which also sees dead processes)
        wins over the last state event."""
        with self._lock:
            s = self.history.summary
            state = state or s.state or RunState.STARTING.value
            eta = self.history.eta() if state == RunState.RUNNING else None
            elapsed = (s.end_time or time.time()) - s.start_time if s.start_time else None
            return Progress(state, s.step, s.total_steps, s.epoch, eta, elapsed, dict(s.train_metrics),
                            dict(s.eval_metrics), s.method)

    def metrics_at(self, step: int) -> dict[str, float]:
        """The train loss logged at `step` and the latest evaluation at or before it."""
        with self._lock:
            found = {}
            loss = dict(self.history.train.get("loss", []))
            if step in loss:
                found["loss"] = loss[step]
            for name, points in self.history.eval.items():
                before = [v for s, v in points if s <= step]
                if before:
                    found[f"eval/{name}"] = before[-1]
            return found

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of rank 0's log (the launcher's before rank 0 has written one)."""
        logs = self.folder.logs
        path = self.folder.rank_log(0)
        if not path.exists():
            path = logs / "launcher.log"
        text = "\n".join(tail_lines(path, lines))
        return f"# {path.name}\n{text}" if text else ""


def compare_series(views: dict[str, RunView]) -> dict[str, dict[str, Series]]:
    """Several runs on one set of axes (the Runs tab's overlay), by run name: the loss plot's
    series "loss · RUN" and "eval loss · RUN", and each other evaluation metric as "METRIC · RUN"."""
    loss: dict[str, Series] = {}
    evals: dict[str, Series] = {}
    for name, view in views.items():
        view.poll()
        series = view.series()
        for kind, points in series["loss"].items():
            loss[f"{'eval loss' if kind == EventType.EVAL else 'loss'} · {name}"] = points
        for metric, points in series["eval"].items():
            evals[f"{metric} · {name}"] = points
    return {"compare_loss": loss, "compare_eval": evals}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _smooth(values: list, weight: float) -> list:
    """Debiased exponential moving average (TensorBoard's smoothing)."""
    out, avg, n = [], 0.0, 0
    weight = min(max(weight, 0.0), 0.999)
    for v in values:
        if not _number(v):
            out.append(None)
            continue
        n += 1
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** n))
    return out


def _series(points: list[tuple[int, float]], name: str) -> list[tuple[int, float, str]]:
    rows = [(step, float(value), name) for step, value in points if _number(value)]
    if len(rows) > MAX_POINTS:  # thin evenly, always keep the newest point
        stride = len(rows) / MAX_POINTS
        rows = [rows[int(i * stride)] for i in range(MAX_POINTS - 1)] + [rows[-1]]
    return rows


def _frame(rows: list[tuple[int, float, str]], y: str) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["step", y, "series"]).astype(
        {"step": "int64", y: "float64", "series": "string"})



def _eval_lines(evals: dict[str, list], pick: Any) -> dict[str, Series]:
    """The evaluation values of the objective's metrics its panels draw for training only
    (rewards and log-probabilities of chosen and rejected): "panel · eval chosen" and the like."""
    out = {}
    for title, lines in PREFERENCE_PANELS:
        drawn = {metric for split, metric, _ in lines if split == "eval"}
        for split, metric, label in lines:
            if split == "train" and metric not in drawn and (points := pick(evals.get(metric, []))):
                out[f"{title} · eval {label}" if label != "train" else f"{title} · eval"] = points
    return out
