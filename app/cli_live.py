"""The terminal's live line (`./launch.sh train` / `watch`): one line that fits the terminal.

    epoch 1 ━━━━━━━━━━━━━━━━━━━━━━━━━━━ 12/100  loss 0.6931  reward acc 75%  margin +0.420  eta 0:01:10

Every value carries its label (the step's `loss` and the evaluation's `eval loss` are two
values, never two bare "loss" numbers). The line is laid out for the width the terminal gives
it: the progress bar always stays (at least MIN_BAR cells), and when the values do not fit the
least useful go first (each value's `rank`: the loss last, the elapsed time first). A preference
run shows its reward accuracy and margin (TRL's rewards/accuracies and rewards/margins), a GRPO
run its mean reward, right after the loss.

Rich's Progress keeps its timing (elapsed, ETA from the step rate); the line is its only column,
drawn by `LiveLine`, which reads the width at render time (a resized terminal re-lays it out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.progress import Progress, ProgressColumn, Task
from rich.text import Text

MIN_BAR, MAX_BAR = 10, 40  # the bar's cells: never fewer (it is the line's point), never more
GAP = "  "                 # between values


@dataclass(frozen=True)
class Value:
    """One labelled value of the line. `rank`: how soon it goes when the line is too narrow
    (higher goes first); `order`: where it stands in the line."""
    label: str
    text: str
    rank: int
    order: int

    def shown(self) -> str:
        return f"{self.label} {self.text}"


# key in the event -> (label, format, rank, order); the rank says what is dropped first
TRAIN_VALUES: dict[str, tuple[str, str, int, int]] = {
    "loss": ("loss", "{:.4f}", 0, 0),
    "rewards/accuracies": ("reward acc", "{:.0%}", 1, 1),   # dpo, ipo, orpo, simpo (kto has none)
    "rewards/margins": ("margin", "{:+.3f}", 2, 2),
    "reward": ("reward", "{:.3f}", 1, 1),                   # grpo: the mean reward of the step's samples
    "kl": ("kl", "{:.3f}", 5, 4),
    "lr": ("lr", "{:.1e}", 6, 6),
    "tokens_per_s": ("tok/s", "{:.0f}", 7, 7),
}
EVAL_RANK, EVAL_OTHER_RANK, EVAL_ORDER = 3, 8, 3  # eval loss after the train values; other eval metrics later
ETA_RANK, ELAPSED_RANK = 4, 9


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def train_values(event: dict) -> dict[str, Value]:
    """The labelled values of a `train` event (those it has), keyed by the event's key."""
    found = {}
    for key, (label, fmt, rank, order) in TRAIN_VALUES.items():
        if _number(event.get(key)):
            found[key] = Value(label, fmt.format(event[key]), rank, order)
    return found


def eval_values(event: dict) -> dict[str, Value]:
    """The labelled values of an `eval` event: `eval loss` (kept long), then its other metrics."""
    found = {}
    for key, value in event.items():
        if key.startswith("eval/") and _number(value):
            name = key[5:]
            rank = EVAL_RANK if name == "loss" else EVAL_OTHER_RANK
            label = TRAIN_VALUES[name][0] if name in TRAIN_VALUES else name  # eval/rewards/accuracies: reward acc
            found[key] = Value(f"eval {label}", f"{value:.4g}", rank, EVAL_ORDER)
    return found


def _clock(seconds: float | None) -> str | None:
    if seconds is None or not math.isfinite(seconds):
        return None
    return str(timedelta(seconds=int(seconds)))


def layout(description: str, completed: float, total: float | None, values: Iterable[Value],
           width: int) -> Text:
    """The line for `width` cells: description, bar, step count, then the values that fit, the
    least useful dropped first; the bar takes what is left (MIN_BAR to MAX_BAR cells)."""
    count = f"{int(completed)}/{int(total)}" if total else f"{int(completed)}"
    head = f"{description} "
    kept = sorted(values, key=lambda v: (v.order, v.rank))

    def used(vals: list[Value]) -> int:
        return len(head) + MIN_BAR + 1 + len(count) + sum(len(GAP) + len(v.shown()) for v in vals)

    while kept and used(kept) > width:
        kept.remove(max(kept, key=lambda v: v.rank))
    bar_width = max(MIN_BAR, min(MAX_BAR, MIN_BAR + width - used(kept)))
    if len(head) + bar_width + 1 + len(count) > width:  # narrower than the bar and the count: shorten the name
        head = head[:max(0, width - bar_width - 1 - len(count))]
    line = Text(head, style="bold")
    line.append_text(_bar(completed, total, bar_width))
    line.append(" " + count, style="progress.download")
    for v in kept:
        line.append(GAP + v.label + " ", style="dim")
        line.append(v.text)
    line.no_wrap, line.overflow = True, "crop"
    return line


def _bar(completed: float, total: float | None, width: int) -> Text:
    """The progress bar as text (no total yet: an empty bar)."""
    done = int(width * min(1.0, completed / total)) if total else 0
    bar = Text("━" * done, style="bar.complete")
    bar.append("━" * (width - done), style="bar.back")
    return bar


class LiveLine:
    """A task's line, laid out at render time for the width it is given."""

    def __init__(self, task: Task):
        self.task = task

    def values(self) -> list[Value]:
        task = self.task
        found = list((task.fields.get("values") or {}).values())
        eta = _clock(task.time_remaining) if task.total else None
        if eta is not None:
            found.append(Value("eta", eta, ETA_RANK, 8))
        elapsed = _clock(task.elapsed)
        if elapsed is not None:
            found.append(Value("elapsed", elapsed, ELAPSED_RANK, 9))
        return found

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(min(options.max_width, MIN_BAR), options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        task = self.task
        yield layout(task.description, task.completed, task.total, self.values(), options.max_width)


class LiveColumn(ProgressColumn):
    """The Progress's one column: the whole line."""

    def render(self, task: Task) -> LiveLine:
        return LiveLine(task)


def live_progress(console: Console) -> Progress:
    """The terminal's progress display (its tasks take `values`: {key: Value}); plain lines
    instead when the output is no terminal."""
    return Progress(LiveColumn(), console=console, transient=False, disable=not console.is_terminal,
                    expand=True)


def plain(values: Iterable[Value]) -> str:
    """The values as one plain line (a log, no terminal): all of them, labelled, in order."""
    return GAP.join(v.shown() for v in sorted(values, key=lambda v: v.order))
