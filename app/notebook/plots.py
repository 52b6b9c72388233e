"""The live plots as one PNG (matplotlib's Agg canvas): it shows in a plain `widgets.Image`,
needs no browser extension, and renders the same headless in a test.

Six panels: loss (training, and evaluation where there is one), the other evaluation metrics,
learning rate, tokens/s, memory and step time; a preference run adds rows for its TRL metrics
(rewards of chosen and rejected, reward accuracy and margin, log-probabilities; KTO's kl, ORPO's
terms: `app.series.preference_panels`), which an SFT run does not have. A figure is made per render and never registered with pyplot, so
nothing global is touched from the watcher thread.
"""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from app.series import RunHistory, preference_panels

# (title, [(split, metric, label)]) per panel
PANELS = (
    ("loss", [("train", "loss", "train"), ("eval", "loss", "eval")]),
    ("learning rate", [("train", "lr", "lr")]),
    ("tokens / s", [("train", "tokens_per_s", "tokens/s")]),
    ("memory (MiB)", [("train", "mem_mb", "rank 0")]),
    ("step time (s)", [("train", "step_time", "s")]),
)
# drawn elsewhere (loss) or the same curve again (perplexity = exp(loss)), unless alone
_OTHER_EVAL_SKIP = ("loss", "perplexity")


def render_png(history: RunHistory, width_px: int = 960, height_px: int = 480, dpi: int = 100) -> bytes:
    """The run's series drawn as a 2 x 3 grid of small plots (and a row of 3 more per three
    preference panels, each `height_px / 2` high); PNG bytes."""
    preference = preference_panels(history.train, history.eval)
    extra_rows = -(-len(preference) // 3)
    fig = Figure(figsize=(width_px / dpi, height_px * (2 + extra_rows) / 2 / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    loss_ax, eval_ax, *rest = fig.subplots(2 + extra_rows, 3).flatten()
    for ax, (title, lines) in zip(rest[len(PANELS) - 1:], preference):
        _panel(ax, title, lines)
    for ax in rest[len(PANELS) - 1 + len(preference):]:
        ax.set_visible(False)  # the last row's empty places
    for ax, (title, lines) in zip([loss_ax, *rest], PANELS):
        _panel(ax, title, [(label, _points(history, split, name)) for split, name, label in lines])
    others = [(n, p) for n, p in sorted(history.eval.items()) if n not in _OTHER_EVAL_SKIP]
    if not others and "perplexity" in history.eval:
        others = [("perplexity", history.eval["perplexity"])]
    _panel(eval_ax, "evaluation", others)
    fig.tight_layout(pad=0.6)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _points(history: RunHistory, split: str, name: str) -> list[tuple[int, float]]:
    return (history.train if split == "train" else history.eval).get(name, [])


def _panel(ax, title: str, lines: list[tuple[str, list[tuple[int, float]]]]) -> None:
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    drawn = 0
    for label, points in lines:
        if not points:
            continue
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 20 else None, markersize=3,
                linewidth=1.2, label=label)
        drawn += 1
    if drawn == 0:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", fontsize=8, alpha=0.6,
                transform=ax.transAxes)
    elif drawn > 1 or title in ("evaluation", "rewards", "log-probability"):
        ax.legend(fontsize=7)
    ax.set_xlabel("step", fontsize=7)
