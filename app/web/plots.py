"""The web app's live plots: one `gr.HTML` per plot whose script (plots.js) keeps the points the
page has and draws them as a small SVG. A page says what it has (the last point of each series,
through `window.livetunePlots`, read by the live feed, feed.js); `batch` answers with
only what is missing: the points after that one, or the whole series (thinned to MAX_POINTS)
when the page has none of it or the run was rewound. Watching a run so costs a few points per
tick, not a redraw of every plot's whole history. Hidden tabs get nothing (train.py).

Each plot's empty box says what will appear there and when. The loss plot draws the raw loss,
its smoothing (a slider in the plot, applied in the page) and the evaluation loss over both,
with a log-scale toggle; evaluation metrics each get their own panel, colour and scale. A
preference run's metrics (rewards of chosen and rejected, reward accuracy and margin,
log-probabilities; KTO's kl, ORPO's terms) share one plot of panels, laid out side by side as
the width allows; the plot stays hidden for a run that logs none of them (SFT). A GRPO run's mean
reward is a panel there too. That plot is the objective's own, so it comes first (make_plots), each
panel's lines smoothed as the loss is (its own slider).
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app.web.backend.views import MAX_POINTS, Series

JS = (Path(__file__).with_name("plots.js")).read_text()

PALETTE = ["#4f46e5", "#059669", "#d97706", "#db2777", "#0891b2", "#7c3aed", "#65a30d", "#dc2626"]
COLORS = {"raw": "#4f46e5", "raw_faded": "#818cf8", "eval": "#ea580c", "chosen": "#059669", "rejected": "#dc2626",
          "train": "#4f46e5"}

CSS = """
.lt-plot { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 6px 8px; min-height: 120px; }
.lt-head { display: flex; flex-wrap: wrap; gap: 10px; align-items: center; font-size: 0.9em; }
.lt-head b { margin-right: auto; }
.lt-head label { display: inline-flex; gap: 4px; align-items: center; font-size: 0.85em; }
.lt-smooth input { width: 90px; }
.lt-empty { color: var(--body-text-color-subdued); font-size: 0.9em; padding: 30px 10px; text-align: center; }
.lt-legend { display: flex; flex-wrap: wrap; gap: 10px; font-size: 0.8em; }
.lt-key i { display: inline-block; width: 12px; height: 3px; margin-right: 4px; vertical-align: middle; }
.lt-canvas svg { display: block; }
.lt-frame { fill: none; stroke: var(--border-color-primary); }
.lt-grid { stroke: var(--border-color-primary); stroke-dasharray: 2 3; }
.lt-tick { font-size: 10px; fill: var(--body-text-color-subdued); }
.lt-title { font-size: 11px; font-weight: 600; }
"""


@dataclass(frozen=True)
class PlotSpec:
    """What one plot draws: which of the view's series, its title and empty-box text."""
    name: str            # the key in RunView.series()
    title: str
    empty: str
    smoothable: bool = False
    log_toggle: bool = False
    panels: bool = False  # one panel (own scale) per series (per kind, comparing)
    height: int = 220
    compare: bool = False  # series named "kind · run", one colour per run
    grouped: bool = False  # series named "panel · line": one panel per group, lines coloured by label
    hide_empty: bool = False  # hidden until it has a point (a plot only some runs have)


SPECS = {
    "loss": PlotSpec("loss", "Loss: train (raw, smoothed) and eval",
                     "The training loss appears here after the first step is logged "
                     "(every logging.log_every_n_steps steps); the evaluation loss joins it at each evaluation.",
                     smoothable=True, log_toggle=True, height=260),
    "eval": PlotSpec("eval", "Evaluation metrics",
                     "Evaluation metrics (exact match, BLEU, ...) appear here after the first evaluation: every "
                     "eval.every_n_steps steps, at the end of training, or when you press Evaluate now.",
                     panels=True),
    "lr": PlotSpec("lr", "Learning rate", "The learning rate appears here after the first logged step."),
    "tokens": PlotSpec("tokens", "Throughput (tokens / s)", "Tokens per second appear here after the first logged step."),
    "compare_loss": PlotSpec("compare_loss", "Loss of the runs compared (dots: evaluation loss)",
                             "Pick two or more runs above and press Overlay: their loss curves appear "
                             "here on one step axis.", smoothable=True, log_toggle=True, height=300, compare=True),
    "compare_eval": PlotSpec("compare_eval", "Evaluation metrics of the runs compared",
                             "Each evaluation metric the compared runs logged appears here in its own "
                             "panel, one colour per run.", panels=True, compare=True),
    "branch_loss": PlotSpec("branch_loss", "Loss by branch (dots: evaluation loss; grey dashes: abandoned by a rewind)",
                            "Each branch's loss appears here, on one step axis with the branch it forked from; "
                            "the steps a rewind gave up stay, greyed and dashed.", log_toggle=True, height=260,
                            compare=True),
    "branch_lr": PlotSpec("branch_lr", "Learning rate by branch",
                          "Each branch's learning rate appears here once it has logged a step.", compare=True),
    "branch_eval": PlotSpec("branch_eval", "Evaluation metrics by branch",
                            "Each evaluation metric appears here in its own panel, one colour per branch.",
                            panels=True, compare=True),
    "seen": PlotSpec("seen", "Samples drawn from each source (so far)",
                     "The samples drawn from each training source appear here once steps are logged."),
    "memory": PlotSpec("memory", "Memory, rank 0 (MiB)", "Rank 0's memory appears here after the first logged step."),
    "rewards": PlotSpec("rewards", "Objective: rewards, reward accuracy and margin, log-probabilities "
                        "(TRL's names); GRPO's mean reward",
                        "A preference or GRPO run's rewards appear here after its first logged step.",
                        smoothable=True, panels=True, grouped=True, hide_empty=True),
}


def _template(spec: PlotSpec, elem_id: str, smoothing: float) -> str:
    data = {"id": elem_id, "colors": COLORS, "palette": PALETTE, "smoothable": spec.smoothable,
            "panels": spec.panels, "height": spec.height, "smoothing": smoothing, "compare": spec.compare,
            "grouped": spec.grouped, "hide_empty": spec.hide_empty}
    controls = ""
    if spec.smoothable:
        controls += (f"<label class='lt-smooth' title='TensorBoard-style exponential moving average'>smoothing "
                     f"<input type='range' min='0' max='0.99' step='0.01' value='{smoothing}'>"
                     f"<output>{smoothing:.2f}</output></label>")
    if spec.log_toggle:
        controls += "<label class='lt-log'><input type='checkbox'> log scale</label>"
    return (f"<div class='lt-plot' data-spec='{html.escape(json.dumps(data), quote=True)}'>"
            f"<div class='lt-head'><b>{html.escape(spec.title)}</b>{controls}</div>"
            f"<div class='lt-legend'></div><div class='lt-canvas'></div>"
            f"<div class='lt-empty'>{html.escape(spec.empty)}</div></div>")


def live_plot(name: str, elem_id: str, smoothing: float = 0.9) -> gr.HTML:
    """One live plot (SPECS[name]) as a gr.HTML component; its value is a JSON batch."""
    return gr.HTML("", html_template=_template(SPECS[name], elem_id, smoothing), js_on_load=JS,
                   elem_id=elem_id, css_template=CSS, apply_default_css=False)


@dataclass
class Plots:
    """A tab's plots by name (SPECS keys)."""
    by_name: dict[str, gr.HTML]
    prefix: str

    def components(self) -> list[gr.HTML]:
        return list(self.by_name.values())

    def elem_id(self, name: str) -> str:
        return plot_id(self.prefix, name)


PREFERENCE_PLOTS = ("rewards",)           # every run view's, first: shown once a run logs rewards
MAIN_PLOTS = ("loss", "eval")             # every run view's plots
MORE_PLOTS = ("lr", "tokens", "memory")   # and, in full, these


def plot_id(prefix: str, name: str) -> str:
    """The element id of a tab's plot (what the page's scripts find it by)."""
    return f"{prefix}-plot-{name}"


def make_plots(prefix: str, full: bool = True) -> Plots:
    """The plots of a run: a preference or GRPO run's rewards first (the objective's own; hidden
    for an SFT run), then loss and evaluation metrics, with `full` also lr, tokens/s, memory."""
    plots: dict[str, gr.HTML] = {}
    for names in (PREFERENCE_PLOTS, MAIN_PLOTS, MORE_PLOTS) if full else (PREFERENCE_PLOTS, MAIN_PLOTS):
        with gr.Row(equal_height=True):
            for name in names:
                plots[name] = live_plot(name, plot_id(prefix, name))
    return Plots(plots, prefix)


def batch(series: dict[str, Series], have: dict[str, Any] | None, path: str, seq: int) -> str | None:
    """The JSON batch that brings a page holding `have` ({"path", "last": {series: [step, value]}})
    up to `series`; None when it has everything already."""
    have = have if isinstance(have, dict) and have.get("path") == path else {}
    last = have.get("last") or {}
    out: dict[str, dict] = {}
    for name, points in series.items():
        part = _missing(points, last.get(name))
        if part is not None:
            out[name] = part
    for name in set(last) - set(series):  # a series the run no longer has (rewound before it)
        out[name] = {"reset": True, "points": []}
    if not out and have:
        return None
    return json.dumps({"path": path, "seq": seq, "series": out}, separators=(",", ":"))


def _missing(points: Series, known: Any) -> dict | None:
    """The points after the page's last one, or the whole (thinned) series when the page's last
    point is not in it (none yet, or the run was rewound and trained those steps again)."""
    if isinstance(known, (list, tuple)) and len(known) == 2:
        step, value = known
        index = _index_of(points, step)
        if index is not None and _same(points[index][1], value):
            new = points[index + 1:]
            return {"reset": False, "points": [list(p) for p in new]} if new else None
    return {"reset": True, "points": [list(p) for p in thin(points)]}


def _index_of(points: Series, step: Any) -> int | None:
    lo, hi = 0, len(points)
    while lo < hi:  # the steps of a series only go up
        mid = (lo + hi) // 2
        if points[mid][0] < step:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(points) and points[lo][0] == step else None


def _same(a: float, b: Any) -> bool:
    return isinstance(b, (int, float)) and math.isclose(a, float(b), rel_tol=1e-9, abs_tol=1e-12)


def thin(points: Series, limit: int = MAX_POINTS) -> Series:
    """At most `limit` points, evenly spaced, the newest always kept (the log keeps them all)."""
    if len(points) <= limit:
        return list(points)
    stride = len(points) / limit
    return [points[int(i * stride)] for i in range(limit - 1)] + [points[-1]]
