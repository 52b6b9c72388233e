"""The Train tab: Start, Pause / Resume, Stop (as the contract's Stop means it: saving first) and
its opposite, Save now, Evaluate now, a live learning-rate change; state, step, epoch, progress
and ETA; live plots rebuilt from the event log (so a reloaded page shows the whole history); the
log tail; a banner when the run fails. Which buttons are enabled follows the run's state through
`contract.protocol.allowed_commands`; every handler returns its outputs keyed by component."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from app.session import STOP_SAVES, SessionError, allowed
from app.web.backend import Backend
from app.web.configure import ConfigureTab, start_run
from contract.protocol import Evaluate, Pause, Resume, Save, Set
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

# button -> the command it sends; a button is enabled when the run's state allows its command
# (contract.protocol.allowed_commands, the table every front end follows)
COMMAND_OF = {"pause": "pause", "resume": "resume", "stop": "stop", "stop_other": "stop",
              "save": "save", "evaluate": "evaluate", "set_lr": "set"}
# "stop" is Stop() as the contract defines it; "stop_other" is the same with the save the other way
OTHER_SAVE = not STOP_SAVES


def _stop_label(save: bool) -> str:
    return "Stop and save" if save else "Stop without saving"


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
            "stop": gr.Button(_stop_label(STOP_SAVES), variant="stop", interactive=False,
                              elem_id="train-stop", min_width=120),
            "stop_other": gr.Button(_stop_label(OTHER_SAVE), variant="stop", interactive=False,
                                    elem_id="train-stop-save" if OTHER_SAVE else "train-stop-nosave",
                                    min_width=150),
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
    view = TrainView(run_state, seen, open_train, status, banner, plots, log, lr, buttons)

    def tick(path: str | None, shown: dict | None, smooth: float, navigated: bool) -> dict:
        return refresh(backend, view, path, shown, smooth, open_tab=not navigated)

    # the page's first look skips the queue (one plain request: the page is shown sooner)
    for trigger, queued in ((page.load, False), (timer.tick, True)):
        trigger(tick, inputs=[run_state, seen, smoothing, navigated], outputs=view.outputs(), js=NAVIGATED_JS,
                show_progress="hidden", concurrency_limit=None, api_visibility="private", queue=queued).then(
            None, inputs=open_train, js=OPEN_TRAIN_JS, api_visibility="private", show_progress="hidden")
    # a new smoothing redraws the loss plot at the next tick
    smoothing.release(lambda shown: {**(shown or {}), "version": -1}, inputs=seen, outputs=seen,
                      api_visibility="private")
    start.click(readable(lambda given: start_run(backend, configure.values(given), run_state, tabs)),
                inputs=configure.inputs, outputs=[run_state, tabs], api_visibility="private")

    def act(what: str):
        def handler(path: str | None, new_lr: float | None = None) -> None:
            _act(backend, what, path, new_lr)
        return readable(handler)

    for name in ("pause", "resume", "save", "evaluate", "stop", "stop_other"):
        buttons[name].click(act(name), inputs=run_state, outputs=None, concurrency_limit=None,
                            api_visibility="private")
    buttons["set_lr"].click(act("set_lr"), inputs=[run_state, lr], outputs=None, concurrency_limit=None,
                            api_visibility="private")
    return TrainTab(plots, status)


@dataclass
class TrainView:
    """The components one look at the run updates."""
    run_state: gr.State
    seen: gr.State
    open_train: gr.Checkbox
    status: gr.HTML
    banner: gr.HTML
    plots: Plots
    log: gr.Code
    lr: gr.Number
    buttons: dict[str, gr.Button]

    def outputs(self) -> list:
        return [self.run_state, self.seen, self.open_train, self.status, self.banner,
                *self.plots.components(), self.log, self.lr, *self.buttons.values()]

    def controls(self, state: str | None) -> dict:
        """Each button enabled when the run's state allows its command."""
        ok = allowed(state)
        return {button: gr.update(interactive=COMMAND_OF[name] in ok) for name, button in self.buttons.items()}


def refresh(backend: Backend, view: TrainView, path: str | None, shown: dict | None, smoothing: float,
            open_tab: bool = True) -> dict:
    """One look at the run: everything that changed since what the page has `shown` (the rest
    is left as it is). `shown` is {"path", "version" (of the run's view)}; None on the page's
    first tick, which also asks the page to open the Train tab when the run is going."""
    first_tick = shown is None
    path = path or backend.session.default_run()
    shown = shown if shown and shown.get("path") == path else {"path": path, "version": -1}
    if path is None:
        return {view.run_state: None, view.seen: shown, view.open_train: False,
                view.status: status_html(None), **view.controls(None)}
    try:
        snap = backend.watch.snapshot(path)
    except SessionError as e:
        return {view.run_state: path, view.seen: shown, view.open_train: False,
                view.status: status_html(None, str(e)), **view.controls(None)}
    text = banner_html(snap.failure, backend.session.stop_error(path))
    out = {view.run_state: path, view.open_train: first_tick and open_tab and snap.info.alive,
           view.status: status_html(snap), view.banner: gr.update(value=text, visible=bool(text)),
           **view.controls(snap.info.state)}
    if snap.version == shown["version"]:
        return {**out, view.seen: shown}
    out.update(zip(view.plots.components(), view.plots.updates(backend.watch.frames(path, smoothing))))
    out[view.log] = backend.watch.log_tail(path)
    # the learning-rate box starts at the run's present value when the page first shows the run
    if shown["version"] == -1 and "lr" in snap.progress.last:
        out[view.lr] = float(f"{snap.progress.last['lr']:.4g}")
    return {**out, view.seen: {"path": path, "version": snap.version}}


def _act(backend: Backend, what: str, path: str | None, new_lr: Any = None) -> None:
    session = backend.session
    if what in ("stop", "stop_other"):
        save = STOP_SAVES if what == "stop" else OTHER_SAVE
        info = session.stop(path, save=save)
        gr.Info(f"Stopping {info.name}{' (saving first)' if save else ''} ...")
        return
    if what == "set_lr":
        if new_lr is None or not new_lr >= 0:
            raise SessionError(f"the learning rate must be a number >= 0, got {new_lr}")
        result = session.send(path, Set(lr=float(new_lr)))
        gr.Info(f"Learning rate set to {result['changes']['lr']:.3g} at step {result['step']}")
        return
    command = {"pause": Pause(), "resume": Resume(), "save": Save(), "evaluate": Evaluate()}[what]
    result = session.send(path, command)
    step = result.get("step")
    messages = {"pause": f"Paused at step {step}; the model stays in memory (chat still works).",
                "resume": f"Resumed at step {step}.",
                "save": f"Saved a checkpoint at step {step}: {result.get('checkpoint')}",
                "evaluate": f"Evaluated at step {step}: " + ", ".join(
                    f"{k} {v:.4g}" for k, v in (result.get("metrics") or {}).items())}
    gr.Info(messages[what])
