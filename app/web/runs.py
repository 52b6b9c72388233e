"""The Runs tab: past and present runs with their state and final metrics; open one to see its
plots and config (the Train tab follows it too); reattach to one still going."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd
import yaml

from app.session import SessionError
from app.web.backend import Backend
from app.web.backend.views import compare_series
from app.web.plots import Plots, batch, live_plot, make_plots
from app.web.widgets import TABLE_CLASS, duration, readable
from contract.run_folder import RunFolder

# each column's share of the table's width (as the Checkpoints tab's: given, not measured)
COLUMNS = {"run": "12%", "objective": "7%", "state": "10%", "step": "7%", "loss": "6%", "eval metrics": "15%",
           "started": "10%", "duration": "6%", "why it ended": "12%", "path": "15%"}


def build(backend: Backend, run_state: gr.State, tabs: gr.Tabs) -> dict:
    table = gr.Dataframe(pd.DataFrame(columns=list(COLUMNS)), interactive=False, elem_id="runs-table",
                         wrap=True, max_height=360, column_widths=list(COLUMNS.values()), elem_classes=[TABLE_CLASS])
    with gr.Row(equal_height=True):
        chosen = gr.Dropdown([], label="Run", scale=3, elem_id="runs-choice")
        refresh_btn = gr.Button("Refresh", scale=1, elem_id="runs-refresh")
        open_btn = gr.Button("Open", variant="primary", scale=1, elem_id="runs-open")
        attach_btn = gr.Button("Reattach", scale=1, elem_id="runs-attach")
    summary = gr.Markdown("", elem_id="runs-summary")
    plots = make_plots("runs", full=False)
    config = gr.Code("", language="yaml", label="Config", lines=14, max_lines=24, interactive=False,
                     elem_id="runs-config")
    with gr.Accordion("Compare runs: their loss and evaluation curves on one set of axes", open=False,
                      elem_id="runs-compare-fold"):
        with gr.Row(equal_height=True):
            compared = gr.Dropdown([], multiselect=True, label="Runs to compare", scale=4, elem_id="runs-compare")
            overlay = gr.Button("Overlay", variant="primary", scale=1, elem_id="runs-overlay")
        with gr.Row(equal_height=True):
            overlay_loss = live_plot("compare_loss", "runs-compare-loss")
            overlay_eval = live_plot("compare_eval", "runs-compare-eval")

    view = RunsView(run_state, tabs, table, chosen, summary, plots, config)
    def listing(path: str | None) -> dict:
        found = _listing(backend, view, path)
        found[compared] = gr.update(choices=found[view.chosen]["choices"])
        return found

    refresh = dict(fn=listing, inputs=run_state, outputs=[table, chosen, compared],
                   api_visibility="private", show_progress="hidden")
    refresh_btn.click(**refresh)
    shown = [summary, *plots.components(), config]
    # the run picked (or preselected by the listing) shows at once; Open makes the page follow it
    chosen.change(readable(lambda path: _show(backend, view, path)), inputs=chosen, outputs=shown,
                  api_visibility="private", show_progress="hidden")
    open_btn.click(readable(lambda name: _open(backend, view, name)), inputs=chosen, outputs=[run_state, *shown],
                   api_visibility="private")
    overlay.click(readable(lambda paths: _overlay(backend, paths, overlay_loss, overlay_eval)), inputs=compared,
                  outputs=[overlay_loss, overlay_eval], api_visibility="private")
    attach_btn.click(readable(lambda name: _attach(backend, view, name)), inputs=chosen,
                     outputs=[run_state, tabs], api_visibility="private")
    return refresh


@dataclass
class RunsView:
    run_state: gr.State
    tabs: gr.Tabs
    table: gr.Dataframe
    chosen: gr.Dropdown
    summary: gr.Markdown
    plots: Plots
    config: gr.Code


def _listing(backend: Backend, view: RunsView, path: str | None) -> dict:
    infos = backend.session.runs()
    rows = []
    for i in infos:
        loss = i.metrics.get("loss")
        evals = ", ".join(f"{k[5:]} {v:.4g}" for k, v in i.metrics.items() if k.startswith("eval/"))
        end = i.end_time or (time.time() if i.alive else None)
        took = end - i.start_time if end and i.start_time else None
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(i.start_time)) if i.start_time else ""
        state = i.state + (" (stopped by user)" if i.stopped_by_user else "")
        rows.append([i.name, _objective(i.path), state, f"{i.step} / {i.total_steps}" if i.total_steps else str(i.step),
                     f"{loss:.4f}" if loss is not None else "", evals, started, duration(took),
                     _why(i.error or i.reason), i.path])
    choices = [(f"{i.name} ({i.state})", i.path) for i in infos]
    selected = path if path in {c[1] for c in choices} else (choices[0][1] if choices else None)
    return {view.table: pd.DataFrame(rows, columns=list(COLUMNS)),
            view.chosen: gr.update(choices=choices, value=selected)}


def _objective(path: str) -> str:
    """The run's objective (preference.objective of its config.yaml; sft when it names none)."""
    try:
        config = yaml.safe_load(RunFolder(Path(path)).config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ""
    return str((config.get("preference") or {}).get("objective") or "sft")


def _why(text: str | None, limit: int = 160) -> str:
    """A failure's (or an early end's) reason, its first line cut to fit a cell; the run's summary
    below the table shows it whole."""
    line = (text or "").strip().splitlines()[0] if text and text.strip() else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _open(backend: Backend, view: RunsView, path: str | None) -> dict:
    """The run shown, and the page's run from now on (the Train, Chat and Checkpoints tabs)."""
    if not path:
        raise gr.Error("Pick a run first.", print_exception=False)
    shown = _show(backend, view, path)
    shown[view.summary] += "\n\nThe Train, Chat and Checkpoints tabs now show this run."
    return {view.run_state: backend.session.resolve(path), **shown}


def _show(backend: Backend, view: RunsView, path: str | None) -> dict:
    """The run's summary, plots and config (nothing when no run is picked)."""
    if not path:
        return {view.summary: "", view.config: "",
                **{plot: batch({}, None, "", time.time_ns()) for plot in view.plots.by_name.values()}}
    snap = backend.watch.snapshot(path)
    series = backend.watch.view(snap.path).series()
    p, info = snap.progress, snap.info
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in info.metrics.items() if k in ("loss",) or k.startswith("eval/"))
    text = (f"**{info.name}** — {info.state}, step {p.step}{f' / {p.total}' if p.total else ''}, "
            f"ran {duration(p.elapsed_s)}. {metrics}")
    if info.error:
        text += f"\n\n**Failed:** {info.error}"
    try:
        config = backend.watch.config_text(snap.path)
    except SessionError as e:
        config = f"# {e}"
    return {view.summary: text, view.config: config,
            **{plot: batch(series.get(name, {}), None, snap.path, time.time_ns())
               for name, plot in view.plots.by_name.items()}}


def _overlay(backend: Backend, paths: list[str] | None, loss: gr.HTML, evals: gr.HTML) -> dict:
    """The compared runs' curves, each run in its own colour (named by its folder)."""
    if not paths:
        raise gr.Error("Pick the runs to compare first.", print_exception=False)
    views = {Path(p).name: backend.watch.view(backend.session.resolve(p)) for p in paths}
    series = compare_series(views)
    key = "compare:" + ",".join(sorted(paths))  # the page keeps nothing from another comparison
    return {loss: batch(series["compare_loss"], None, key, time.time_ns()),
            evals: batch(series["compare_eval"], None, key, time.time_ns())}


def _attach(backend: Backend, view: RunsView, path: str | None) -> dict:
    if not path:
        raise gr.Error("Pick a run first.", print_exception=False)
    info = backend.session.attach(path)
    gr.Info(f"Reattached to {info.name} ({info.state}).")
    return {view.run_state: info.path, view.tabs: gr.Tabs(selected="train")}
