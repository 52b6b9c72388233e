"""Pieces the tabs share: the status line and failure banner (HTML made from the
backend's values), the page style, and `readable`, which turns a backend failure into a message
in the page instead of a stack trace."""

from __future__ import annotations

import functools
import html
import inspect
from pathlib import Path
from typing import Any, Callable

import gradio as gr

from app.session import SessionError
from app.web.backend.watch import Snapshot
from contract.branches import TREE_FILE, BranchTree
from contract.config.schema import ConfigError
from contract.protocol.states import RunState
from contract.run_folder import RunFolder
from contract.protocol.base import ProtocolError
from supervisor import Failure
from supervisor.slurm import recorded_job

STATE_COLORS = {RunState.QUEUED.value: "#0891b2", RunState.STARTING.value: "#6b7280", RunState.RUNNING.value: "#059669",
                RunState.PAUSED.value: "#d97706", RunState.STOPPING.value: "#7c3aed",
                RunState.FINISHED.value: "#2563eb", RunState.FAILED.value: "#dc2626"}

CSS = """
.cfg-field.invalid .info-text { color: #dc2626 !important; }
.cfg-field.warned .info-text { color: #b45309 !important; }
.cfg-field.invalid { border-color: #fca5a5 !important; box-shadow: 0 0 0 1px #fca5a5 !important; }
.cfg-field.invalid input, .cfg-field.invalid textarea { border-color: #dc2626 !important; }
.inspect-note p { font-size: 0.85em; margin: 2px 0 !important; }
.problems-box { border-left: 4px solid #dc2626; padding: 6px 12px !important; background: #fef2f2; }
.ok-box { border-left: 4px solid #059669; padding: 6px 12px !important; background: #ecfdf5; }
.run-status { display: flex; flex-wrap: wrap; gap: 14px; align-items: center; font-size: 0.95em; }
.state-chip { color: white; border-radius: 999px; padding: 2px 12px; font-weight: 600; }
.progress-outer { width: 100%; height: 10px; background: #e5e7eb; border-radius: 6px; margin-top: 8px; overflow: hidden; }
.progress-inner { height: 100%; background: linear-gradient(90deg, #6366f1, #22c55e); transition: width 0.5s; }
.fail-banner { border: 1px solid #fca5a5; background: #fef2f2; border-radius: 8px; padding: 10px 14px; color: #7f1d1d; }
.fail-banner pre { max-height: 220px; overflow: auto; font-size: 0.8em; background: #fff; padding: 6px; white-space: pre-wrap; }
.muted { color: #6b7280; font-size: 0.9em; }
.warn-box { border-left: 4px solid #d97706; padding: 6px 12px !important; background: #fffbeb; margin-top: 6px; }
.provenance { font-size: 0.85em; color: #374151; }
.provenance ul { margin: 2px 0 2px 1.2em; }
.own-note { color: #92400e; }
.branch-live { font-weight: 600; }
footer { display: none !important; }
.lt-table th .header { word-break: normal !important; overflow-wrap: normal !important; white-space: nowrap !important; }
.lt-table td .cell-wrap { white-space: normal !important; overflow-wrap: anywhere; }
.lt-chat .bubble-wrap { border-top: 40px solid transparent !important; }
"""
# Tables (TABLE_CLASS): a header never breaks inside a word, and a long cell (a path) wraps
# anywhere instead of running off the table's right edge. Chats (CHAT_CLASS): the label floats
# over the top of the scrolling messages, so the messages' window starts below it (a transparent
# top border: the scrolled content stays inside the padding box, under no label).
TABLE_CLASS = "lt-table"
CHAT_CLASS = "lt-chat"


def readable(fn: Callable) -> Callable:
    """Wrap an event handler so a SessionError or ConfigError (or any other failure) reaches the
    user as a readable message box (gr.Error), never as a stack trace; generators too."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen_wrapper(*args: Any, **kwargs: Any):
            try:
                yield from fn(*args, **kwargs)
            except gr.Error:
                raise
            except (SessionError, ConfigError, ProtocolError) as e:
                raise gr.Error(str(e), print_exception=False) from None
            except Exception as e:  # noqa: BLE001 - whatever it is, the page says so in words
                raise gr.Error(f"{type(e).__name__}: {e}", print_exception=False) from None
        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        try:
            return fn(*args, **kwargs)
        except gr.Error:
            raise
        except (SessionError, ConfigError, ProtocolError) as e:
            raise gr.Error(str(e), print_exception=False) from None
        except Exception as e:  # noqa: BLE001
            raise gr.Error(f"{type(e).__name__}: {e}", print_exception=False) from None
    return wrapper


# -- status and failures ------------------------------------------------------------------------

def duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


# the status line's numbers from the last step, those the run logs (TRL's names for an objective's):
# SFT's loss, a preference run's reward accuracy and margin, a GRPO run's mean reward
STATUS_NUMBERS = (("loss", "loss", "{:.4f}"), ("rewards/accuracies", "reward acc", "{:.2f}"),
                  ("rewards/margins", "margin", "{:.3f}"), ("reward", "reward", "{:.3f}"),
                  ("lr", "lr", "{:.2e}"), ("tokens_per_s", "tok/s", "{:.0f}"))


def status_html(snap: Snapshot | None, note: str | None = None) -> str:
    """The status line: state, run, step / total, epoch, ETA, last numbers, a progress bar."""
    if snap is None:
        return ("<div class='lt-status'><div class='run-status'><span class='state-chip' style='background:#9ca3af'>"
                "no run</span><span class='muted'>Configure a run and press Start, or open one in the Runs tab."
                "</span></div></div>")
    p, info = snap.progress, snap.info
    color = STATE_COLORS.get(p.state, "#6b7280")
    total = f" / {p.total}" if p.total else ""
    parts = [f"<span class='state-chip' style='background:{color}' id='run-state'>{html.escape(p.state)}</span>",
             f"<b>{html.escape(info.name)}</b>",
             f"<span id='run-step'>step {p.step}{total}</span>", f"epoch {p.epoch}"]
    tree = BranchTree.load(snap.path) if (Path(snap.path) / TREE_FILE).is_file() else None
    if tree is not None and len(tree.branches) > 1:  # once the run has branched: which branch trains
        parts.append(f"<span id='run-branch'>branch {html.escape(tree.current)}</span>")
    if p.state == RunState.RUNNING:
        parts.append(f"ETA {duration(p.eta_s)}")
    if p.state == RunState.QUEUED:
        job = recorded_job(RunFolder(Path(snap.path)))
        parts.append(f"<span class='muted' id='run-queued'>waiting in Slurm's queue (job {html.escape(str(job))}); "
                     "Stop cancels it</span>")
    parts.append(f"elapsed {duration(p.elapsed_s)}")
    for key, label, fmt in STATUS_NUMBERS:
        if isinstance(p.last.get(key), (int, float)):
            parts.append(f"{label} {fmt.format(p.last[key])}")
    for key, value in list(p.last_eval.items())[:3]:
        parts.append(f"{html.escape(key)} {value:.4g}")
    if note:
        parts.append(f"<span class='muted'>{html.escape(note)}</span>")
    bar = (f"<div class='progress-outer' title='{p.fraction:.0%}'>"
           f"<div class='progress-inner' style='width:{100 * p.fraction:.1f}%'></div></div>")
    # one outer element: the live feed (feed.js) replaces it whole
    return f"<div class='lt-status'><div class='run-status'>{' · '.join(parts)}</div>{bar}</div>"


def banner_html(failure: Failure | None, error: str | None = None) -> str:
    """The red banner of a failed run: what happened, which rank, its last log lines."""
    if failure is None and not error:
        return ""
    if failure is None:
        return f"<div class='fail-banner' id='fail-banner'><b>{html.escape(error)}</b></div>"
    where = f"rank {failure.rank}" if failure.rank is not None else "the run"
    lines = "\n".join(failure.lines)
    log = f" — last lines of {html.escape(failure.log.rsplit('/', 1)[-1])}" if failure.log else ""
    return (f"<div class='fail-banner' id='fail-banner'><b>Run {html.escape(failure.run)} failed "
            f"({html.escape(where)})</b>: {html.escape(failure.message)}{log}"
            f"<pre>{html.escape(lines)}</pre></div>")


def problems_html(problems: list[str], warnings: list[str] | None = None,
                  loud: list[str] | None = None) -> str:
    """The Configure tab's summary: every problem (Start stays disabled), or that the config is
    valid and what the pre-flight check warns of (`loud`: to be seen first, e.g. many rows
    truncated; `warnings`: dropped rows and the like), each naming its field."""
    if not problems:
        ok = "<div class='ok-box'>The config is valid: press <b>Start</b> (or <i>Submit to Slurm</i>).</div>"
        return ok + warnings_html(warnings or [], loud or [])
    items = "".join(f"<li>{html.escape(p)}</li>" for p in problems)
    n = len(problems)
    return (f"<div class='problems-box' id='config-problems'><b>{n} problem{'s' * (n != 1)} to fix "
            f"before Start</b><ul>{items}</ul></div>")


def warnings_html(warnings: list[str], loud: list[str]) -> str:
    """The pre-flight check's warnings, the loud ones first and in bold; empty when none."""
    if not warnings and not loud:
        return ""
    items = "".join(f"<li><b>WARNING {html.escape(w)}</b></li>" for w in loud)
    items += "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    n = len(loud) + len(warnings)
    return (f"<div class='warn-box' id='config-warnings'><b>{n} warning{'s' * (n != 1)} from the "
            f"pre-flight check</b> (the run can start)<ul>{items}</ul></div>")


def provenance_html(by_source: dict[str, list[str]], fitted: list[str]) -> str:
    """Where the form's values come from: {source title: ["key=value", ...]} in order; `fitted`:
    the preset values a run with the user's own model or data would not take."""
    lines = [f"<li><b>{html.escape(title, quote=False)}</b>: {html.escape(', '.join(items), quote=False)}</li>"
             for title, items in by_source.items() if items]
    lines.append("<li>every other field: the schema's default</li>")
    own = ""
    if fitted:
        own = ("<p class='own-note'>Your own model or data, but the embedded default's settings still "
               f"apply to {len(fitted)} field{'s' * (len(fitted) != 1)} ({html.escape(', '.join(fitted))}). "
               "The terminal would not take them: press <i>Fit the settings to my model and data</i> "
               "to do the same here.</p>")
    return f"<div class='provenance' id='config-provenance'><b>Where the values come from</b><ul>{''.join(lines)}</ul>{own}</div>"
