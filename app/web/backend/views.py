"""What the pages show of one run, folded from its events.jsonl as it grows.

The event log is the durable record, so a page opened (or reloaded) at any time rebuilds the
same plots from it: `RunView.poll()` reads only the lines added since the last poll, and
`frames()` turns what was read into the tables the plots draw.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from engine.run_folder import EventTail, RunFolder, tail_lines

# the most points a series sends to the browser; longer runs are thinned evenly (last kept)
MAX_POINTS = 400
# eval metrics that are plotted with the loss, not with the other evaluation metrics
LOSS_LIKE = ("eval/loss", "eval/perplexity")
RATE_WINDOW = 30  # recent step intervals the ETA is taken from


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
    """One run's history; thread-safe (several pages may show the same run)."""

    def __init__(self, folder: RunFolder):
        self.folder = folder
        self._tail = EventTail(folder.events)
        self._lock = threading.Lock()
        self.train: dict[int, dict[str, Any]] = {}
        self.evals: dict[int, dict[str, float]] = {}
        self.state, self.method, self.total = "starting", None, None
        self.first_time: float | None = None
        self.end_time: float | None = None
        self.setup: dict[str, Any] = {}
        self.version = 0  # goes up whenever something new was read
        self.last_line_read_at = 0.0

    def poll(self) -> int:
        """Read what was appended since the last poll; returns the view's version."""
        with self._lock:
            events = self._tail.poll()
            for event in events:
                self._fold(event)
            if events:
                self.version += 1
                self.last_line_read_at = time.time()
            return self.version

    def _fold(self, event: dict) -> None:
        kind = event.get("type")
        if self.first_time is None and isinstance(event.get("time"), (int, float)):
            self.first_time = event["time"]
        if kind == "train" and isinstance(event.get("step"), int):
            self.train[event["step"]] = event
            self.total = event.get("total_steps", self.total)
        elif kind == "eval" and isinstance(event.get("step"), int):
            metrics = {k: v for k, v in event.items() if k.startswith("eval/") and _number(v)}
            self.evals[event["step"]] = {**self.evals.get(event["step"], {}), **metrics}
        elif kind == "setup":
            self.setup = event
            self.total = event.get("total_steps", self.total)
        elif kind == "state":
            self.state = event.get("state", self.state)
            self.method = event.get("method", self.method)
            self.end_time = event.get("time") if self.state in ("finished", "failed") else None

    # -- tables for the plots ---------------------------------------------------------------------
    def frames(self, smoothing: float = 0.9) -> dict[str, pd.DataFrame]:
        """loss (raw, smoothed, eval), eval (other metrics), lr, tokens, memory."""
        with self._lock:
            steps = sorted(self.train)
            records = [self.train[s] for s in steps]
            evals = dict(sorted(self.evals.items()))
        losses = [r.get("loss") for r in records]
        loss_rows = _series(steps, losses, "raw") + _series(steps, _smooth(losses, smoothing), "smoothed")
        loss_rows += _series(list(evals), [e.get("eval/loss") for e in evals.values()], "eval")
        other = sorted({k for e in evals.values() for k in e if k not in LOSS_LIKE})
        eval_rows = [row for name in other
                     for row in _series(list(evals), [e.get(name) for e in evals.values()], name[5:])]
        return {
            "loss": _frame(loss_rows, "loss"),
            "eval": _frame(eval_rows, "value"),
            "lr": _frame(_series(steps, [r.get("lr") for r in records], "lr"), "lr"),
            "tokens": _frame(_series(steps, [r.get("tokens_per_s") for r in records], "tokens/s"), "tokens_per_s"),
            "memory": _frame(_series(steps, [r.get("mem_mb") for r in records], "rank 0"), "mem_mb"),
        }

    def progress(self, state: str | None = None) -> Progress:
        """Where the run is; `state` (from the run manager, which also sees dead processes)
        wins over the last state event."""
        with self._lock:
            steps = sorted(self.train)
            last = self.train[steps[-1]] if steps else {}
            state = state or self.state
            eta = self._eta(steps) if state == "running" else None
            end = self.end_time if self.end_time else time.time()
            elapsed = end - self.first_time if self.first_time else None
            last_eval = self.evals[max(self.evals)] if self.evals else {}
            numbers = {k: v for k, v in last.items() if _number(v) and k not in ("step", "epoch", "time", "total_steps")}
            return Progress(state, steps[-1] if steps else 0, self.total, int(last.get("epoch", 0)),
                            eta, elapsed, numbers, dict(last_eval), self.method)

    def _eta(self, steps: list[int]) -> float | None:
        """Remaining steps x the median recent step interval (robust to pauses and evals)."""
        if not self.total or len(steps) < 3:
            return None
        recent = steps[-RATE_WINDOW - 1:]
        gaps = [(self.train[b]["time"] - self.train[a]["time"]) / (b - a)
                for a, b in zip(recent, recent[1:]) if b > a]
        if not gaps:
            return None
        return max(0.0, (self.total - steps[-1]) * statistics.median(gaps))

    def metrics_at(self, step: int) -> dict[str, float]:
        """The train loss logged at `step` and the latest evaluation at or before it."""
        with self._lock:
            found = {}
            if step in self.train and _number(self.train[step].get("loss")):
                found["loss"] = self.train[step]["loss"]
            before = [s for s in self.evals if s <= step]
            if before:
                found.update(self.evals[max(before)])
            return found

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of rank 0's log (the launcher's before rank 0 has written one)."""
        logs = self.folder.logs
        path = self.folder.rank_log(0)
        if not path.exists():
            path = logs / "launcher.log"
        text = "\n".join(tail_lines(path, lines))
        return f"# {path.name}\n{text}" if text else ""


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


def _series(xs: list[int], ys: list, name: str) -> list[tuple[int, float, str]]:
    points = [(x, float(y), name) for x, y in zip(xs, ys) if _number(y)]
    if len(points) > MAX_POINTS:  # thin evenly, always keep the newest point
        stride = len(points) / MAX_POINTS
        points = [points[int(i * stride)] for i in range(MAX_POINTS - 1)] + [points[-1]]
    return points


def _frame(rows: list[tuple[int, float, str]], y: str) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["step", y, "series"]).astype(
        {"step": "int64", y: "float64", "series": "string"})


def view_for(path: str | Path) -> RunView:
    return RunView(RunFolder(Path(path)))
