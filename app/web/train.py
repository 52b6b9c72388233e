"""The Train tab: Start, Pause / Resume, Stop, Stop and save, Save now, Evaluate now, a live
learning-rate change; state, step, epoch, progress and ETA; live plots rebuilt from the event log
(so a reloaded page shows the whole history); the log tail; a banner when the run fails."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from app.web.backend import Backend, BackendError
from app.web.configure import ConfigureTab, start_run
from app.web.widgets import Plots, banner_html, make_plots, readable, status_html

TICK_S = 0.5  # how often a page looks for news (a look that finds none sends nothing)
# Each tick tells the server whether the user has clicked a tab yet, read in the page as the tick
# leaves (a page state updated through the server could arrive after the first tick); the flag is
# set by a click listener (NAVIGATION_HEAD, given to launch()).
NAVIGATED_JS = "(path, shown, smooth, navigated) => [path, shown, smooth, !!window.livetuneNavigated]"
# opens the Train tab after the page's first look found a run going, unless the user has clicked
# a tab meanwhile (decided in the page when the answer arrives, however late that is)
OPEN_TRAIN_JS = ("(go) => { if (go && !window.livetuneNavigated) { const b = Array.from(document.querySelectorAll("
                 "'button[role=tab]')).find(b => b.innerText.trim() === 'Train'); if (b) b.click(); } }")
NAVIGATION_HEAD = ("<script>document.addEventListener('click', e => { if (e.target.closest && "
                   "e.target.closest('button[role=tab]')) window.livetuneNavigated = true; }, true);</script>")

# which buttons a run's state allows
CONTROLS = ("pause", "resume", "stop", "stop_save", "save", "evaluate", "set_lr")
ALLOWED = {"starting": {"stop"},
           "running": {"pause", "stop", "stop_save", "save", "evaluate", "set_lr"},
           "paused": {"resume", "stop", "stop_save", "save", "evaluate", "set_lr"}}


@dataclass
class TrainTab:
    plots: Plots
    status: gr.HTML


def build(backend: Backend, run_state: gr.State, tabs: gr.Tabs, configure: ConfigureTab,
          timer: gr.Timer, page: gr.Blocks) -> TrainTab:
    """The tab's layout and events. `timer` lives outside the tabs, so it ticks from the moment
    the page loads. The page's load event does the first look at once (the timer's first tick
    comes an interval later) and opens this tab when a run is going, unless the user has picked
    a tab already (NAVIGATED_JS)."""
    banner = gr.HTML("", elem_id="train-banner", visible=False)
    status = gr.HTML(status_html(None), elem_id="train-status")
    with gr.Row():
        start = gr.Button("Start", variant="primary", interactive=configure.start_buttons[0].interactive,
                          elem_id="train-start", min_width=90)
        buttons = {
            "pause": gr.Button("Pause", interactive=False, elem_id="train-pause", min_width=90),
            "resume": gr.Button("Resume", interactive=False, elem_id="train-resume", min_width=90),
            "stop": gr.Button("Stop", variant="stop", interactive=False, elem_id="train-stop", min_width=90),
            "stop_save": gr.Button("Stop and save", variant="stop", interactive=False, elem_id="train-stop-save", min_width=120),
            "save": gr.Button("Save now", interactive=False, elem_id="train-save", min_width=100),
            "evaluate": gr.Button("Evaluate now", interactive=False, elem_id="train-evaluate", min_width=110),
        }
    with gr.Row(equal_height=True):
        lr = gr.Number(label="New learning rate", value=None, step=1e-4, elem_id="train-lr", scale=2,
                       placeholder="e.g. 0.001",
                       info="Takes effect at the next step; the schedule goes on from there, scaled.")
        buttons["set_lr"] = gr.Button("Set learning rate", interactive=False, elem_id="train-set-lr", scale=1)
        smoothing = gr.Slider(0.0, 0.99, value=0.9, step=0.01, label="Loss smoothing", scale=2,
                              elem_id="train-smoothing")
    plots = make_plots("train")
    with gr.Accordion("Log tail (rank 0)", open=False):
        log = gr.Code("", language="shell", lines=14, interactive=False, elem_id="train-log")
    seen = gr.State(None)  # what this page shows: {"path", "version"} (see refresh)
    navigated = gr.Checkbox(False, visible=False)  # filled in by NAVIGATED_JS
    open_train = gr.Checkbox(False, visible=False)  # the first look found a run going
    configure.start_buttons.append(start)

    def tick(path: str | None, shown: dict | None, smooth: float, navigated: bool):
        return refresh(backend, path, shown, smooth, plots, open_tab=not navigated)

    outs = [run_state, seen, open_train, status, banner, *plots.components(), log, lr, *buttons.values()]
    # the page's first look skips the queue (one plain request: the page is shown sooner)
    for trigger, queued in ((page.load, False), (timer.tick, True)):
        trigger(tick, inputs=[run_state, seen, smoothing, navigated], outputs=outs, js=NAVIGATED_JS,
                show_progress="hidden", concurrency_limit=None, api_visibility="private", queue=queued).then(
            None, inputs=open_train, js=OPEN_TRAIN_JS, api_visibility="private", show_progress="hidden")
    # a new smoothing redraws the loss plot at the next tick
    smoothing.release(lambda shown: {**(shown or {}), "version": -1}, inputs=seen, outputs=seen,
                      api_visibility="private")
    start.click(readable(lambda *v: start_run(backend, list(v))), inputs=configure.inputs,
                outputs=[run_state, tabs], api_visibility="private")

    def act(what: str):
        def handler(path: str | None, new_lr: float | None = None):
            return _act(backend, what, path, new_lr)
        return readable(handler)

    for name in ("pause", "resume", "save", "evaluate", "stop", "stop_save"):
        buttons[name].click(act(name), inputs=run_state, outputs=None, concurrency_limit=None,
                            api_visibility="private")
    buttons["set_lr"].click(act("set_lr"), inputs=[run_state, lr], outputs=None, concurrency_limit=None,
                            api_visibility="private")
    return TrainTab(plots, status)


def refresh(backend: Backend, path: str | None, shown: dict | None, smoothing: float, plots: Plots,
            open_tab: bool = True) -> list:
    """One look at the run: everything that changed since what the page has `shown`, gr.skip()
    for the rest. `shown` is {"path", "version" (of the run's view)}; None on the page's first
    tick, which also asks the page to open the Train tab when the run is going."""
    first_tick = shown is None
    path = path or backend.default_run()
    shown = shown if shown and shown.get("path") == path else {"path": path, "version": -1}
    unchanged = [gr.skip()] * (len(plots.components()) + 2)  # plots, log, lr
    off = [gr.update(interactive=False)] * len(CONTROLS)
    if path is None:
        return [None, shown, False, status_html(None), gr.skip(), *unchanged, *off]
    try:
        snap = backend.snapshot(path)
    except BackendError as e:
        return [path, shown, False, status_html(None, str(e)), gr.skip(), *unchanged, *off]
    tab = first_tick and open_tab and snap.info.alive
    allowed = ALLOWED.get(snap.info.state, set())
    controls = [gr.update(interactive=name in allowed) for name in CONTROLS]
    text = banner_html(snap.failure, backend.stop_error(path))
    banner = gr.update(value=text, visible=bool(text))
    if snap.version == shown["version"]:
        return [path, shown, tab, status_html(snap), banner, *unchanged, *controls]
    figures = plots.updates(backend.frames(path, smoothing))
    # the learning-rate box starts at the run's present value when the page first shows the run
    lr = float(f"{snap.progress.last['lr']:.4g}") if shown["version"] == -1 and "lr" in snap.progress.last else gr.skip()
    shown = {"path": path, "version": snap.version}
    return [path, shown, tab, status_html(snap), banner, *figures, backend.log_tail(path), lr, *controls]


def _act(backend: Backend, what: str, path: str | None, new_lr: Any = None) -> None:
    if what == "stop" or what == "stop_save":
        info = backend.stop(path, save=what == "stop_save")
        gr.Info(f"Stopping {info.name}{' (saving first)' if what == 'stop_save' else ''} ...")
        return
    if what == "set_lr":
        result = backend.set_lr(path, new_lr)
        gr.Info(f"Learning rate set to {result['changes']['lr']:.3g} at step {result['step']}")
        return
    result = backend.command(path, what)
    step = result.get("step")
    messages = {"pause": f"Paused at step {step}; the model stays in memory (chat still works).",
                "resume": f"Resumed at step {step}.",
                "save": f"Saved a checkpoint at step {step}: {result.get('checkpoint')}",
                "evaluate": f"Evaluated at step {step}: " + ", ".join(
                    f"{k} {v:.4g}" for k, v in (result.get("metrics") or {}).items())}
    gr.Info(messages[what])
