"""The Train tab: Start, Pause / Resume, Stop (as the contract's Stop means it: saving first) and
its opposite, Save now, Evaluate now, a live learning-rate change and every other live setting
(settings_fold); state, step, epoch, progress and ETA; live plots rebuilt from the event log (so a reloaded page shows the whole history); the
log tail; a banner when the run fails; the chat beside the plots (chat_side). Which buttons are
enabled follows the run's state through `contract.protocol.commands.allowed_commands`; every handler
returns its outputs keyed by component.

Two paths bring the run to the page. What changes every step (the status line, the plots' new
points, the side chat's "running, step N") comes through the page's live feed (feed.py, feed.js),
a plain call a second from the page. What changes rarely (the buttons, the banner, the log tail,
which run the page shows) comes through "the look" (`refresh`), a Gradio event run when the page
loads, when the page's run changes, and when the feed sees the run's state change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import gradio as gr

from app.lr_box import lr_from_box
from app.session import SessionError, allowed
from app.web.access import OPERATOR
from app.web import chat_side, data, feed, samples, settings_fold
from app.web.backend import Backend
from app.web.configure import ConfigureTab, start_run
from app.web.plots import Plots, make_plots
from app.web.widgets import banner_html, readable, status_html
from contract.protocol.commands import Stop
from contract.protocol.roles import Role
from contract.protocol.states import RunState

# Read in the page as each look leaves: the run it shows, whether the user has clicked a tab yet
# (set by a click listener, NAVIGATION_HEAD, given to launch(); a page state updated through the
# server could arrive after the first look), and whether the Train tab and its log are on
# screen: a hidden tab is sent nothing but the run it shows (the feed's marker).
# It also closes the "Stopping ..." note once the status line shows the run ended.
TICK_JS = ("(path, shown, navigated, visible, log_open) => { const on = id => { const e = "
           "document.getElementById(id); return !!e && e.offsetParent !== null && document.visibilityState "
           "!== 'hidden'; }; const s = document.getElementById('run-state'); if (s && /finished|failed/.test("
           "s.innerText)) document.querySelectorAll('.toast-body').forEach(t => { if (/Stopping/.test(t.innerText)) "
           "{ const c = t.querySelector('.toast-close'); if (c) c.click(); } }); return [path, shown, "
           "!!window.livetuneNavigated, on('train-status'), on('train-log')]; }")
# after the page's first look: open the Train tab when it found a run going, unless the user has
# clicked a tab meanwhile
AFTER_TICK_JS = ("(go) => { if (go && !window.livetuneNavigated) { const b = Array.from(document.querySelectorAll("
                 "'button[role=tab]')).find(b => b.innerText.trim() === 'Train'); if (b) b.click(); } }")
NAVIGATION_HEAD = ("<script>document.addEventListener('click', e => { if (e.target.closest && "
                   "e.target.closest('button[role=tab]')) window.livetuneNavigated = true; }, true);</script>")
LIVE_STATES = tuple(s.value for s in RunState if s.live)  # queued (a Slurm job waiting) included
# asked in the page before Start while the shown run is live, and before setting the lr to 0
CONFIRM_START_JS = ("() => { const s = document.getElementById('run-state'); const live = !!s && "
                    f"{list(LIVE_STATES)}.includes(s.innerText.trim()); return !live || window.confirm("
                    "'A run is still going. Start a second run beside it? (To go on with this one, press Resume "
                    "or Cancel here.)'); }")
CONFIRM_LR_JS = ("(lr) => String(lr ?? '').trim() === '' || Number(lr) !== 0 || window.confirm("
                 "'Set the learning rate to 0? The model stops learning until you set it again.')")

# button -> the command it sends; a button is enabled when the run's state allows its command
# (contract.protocol.commands.allowed_commands, the table every front end follows)
COMMAND_OF = {"pause": "pause", "resume": "resume", "stop": "stop", "stop_other": "stop",
              "save": "save", "evaluate": "evaluate", "set_lr": "set", "set_settings": "set"}
# "stop" is Stop() as the contract defines it; "stop_other" is the same with the save the other way
OTHER_SAVE = not Stop().save


def _stop_label(save: bool) -> str:
    return "Stop and save" if save else "Stop without saving"


@dataclass
class TrainTab:
    plots: Plots
    status: gr.HTML


def build(backend: Backend, run_state: gr.State, tabs: gr.Tabs, configure: ConfigureTab,
          page: gr.Blocks, marker: gr.HTML) -> TrainTab:
    """The tab's layout and events. The page's load event does the first look and opens this
    tab when a run is going, unless the user has picked a tab already (TICK_JS); each look
    writes the live feed's `marker` (feed.build: it sits beside the tabs, with the feed)."""
    banner = gr.HTML("", elem_id="train-banner", visible=False)
    status = gr.HTML(status_html(None), elem_id="train-status")
    look_button = gr.Button("look", elem_id=feed.LOOK_ID, visible="hidden")
    with gr.Row():
        start = gr.Button("Start", variant="primary", interactive=configure.start_buttons[0].interactive,
                          elem_id="train-start", elem_classes=[OPERATOR], min_width=90)
        buttons = {
            "pause": gr.Button("Pause", interactive=False, elem_id="train-pause", elem_classes=[OPERATOR], min_width=90),
            "resume": gr.Button("Resume", interactive=False, elem_id="train-resume", elem_classes=[OPERATOR], min_width=90),
            "stop": gr.Button(_stop_label(Stop().save), variant="stop", interactive=False,
                              elem_id="train-stop", elem_classes=[OPERATOR], min_width=120),
            "stop_other": gr.Button(_stop_label(OTHER_SAVE), variant="stop", interactive=False,
                                    elem_id="train-stop-save" if OTHER_SAVE else "train-stop-nosave", elem_classes=[OPERATOR],
                                    min_width=150),
            "save": gr.Button("Save now", interactive=False, elem_id="train-save", elem_classes=[OPERATOR], min_width=100),
            "evaluate": gr.Button("Evaluate now", interactive=False, elem_id="train-evaluate", elem_classes=[OPERATOR], min_width=110),
        }
    with gr.Row(equal_height=True):
        # starts empty (a number shown here would be sent by Set as it is): the present lr is
        # in the status line above
        # text, not a number box: a number box shows 0 when empty, and Set would send it
        lr = gr.Textbox(label="New learning rate", value="", elem_id="train-lr", scale=2, max_lines=1,
                        placeholder="e.g. 0.001 (the present value is in the status line above)",
                        info="Takes effect at the next step; the schedule goes on from there, scaled. "
                             "0 stops learning and is asked about first.")
        buttons["set_lr"] = gr.Button("Set learning rate", interactive=False, elem_id="train-set-lr", elem_classes=[OPERATOR], scale=1)
        side_shown = gr.Checkbox(True, label="Chat beside the plots", elem_id="train-chat-toggle", scale=1)
    buttons["set_settings"] = settings_fold.build(backend, run_state)  # every other live setting of `set`
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=480):
            plots = make_plots("train")
        side = chat_side.build(backend, run_state)  # the chat beside the plots; its header follows the tick
    side_shown.change(lambda on: gr.Column(visible=on), inputs=side_shown, outputs=side.column, queue=False,
                      api_visibility="private", show_progress="hidden")
    data.build(backend, run_state)  # sources, weights, samples drawn, the inbox
    samples.build(backend, run_state)  # a GRPO run's latest samples, rated here
    with gr.Accordion("Log tail (rank 0)", open=False):
        log = gr.Code("", language="shell", lines=14, interactive=False, elem_id="train-log")
    seen = gr.State(None)  # what this page was sent (see refresh)
    navigated = gr.Checkbox(False, visible=False)  # filled in by TICK_JS
    visible = gr.Checkbox(False, visible=False)    # filled in by TICK_JS
    log_open = gr.Checkbox(False, visible=False)   # filled in by TICK_JS
    open_train = gr.Checkbox(False, visible=False)  # the first look found a run going
    confirmed = gr.Checkbox(True, visible=False)    # the page's answer to a confirmation
    configure.start_buttons.append(start)
    view = TrainView(run_state, seen, open_train, status, banner, log, lr, buttons, start, side.note, marker,
                     lambda: backend.session.role_of())  # a viewer's login: the buttons stay disabled

    def tick(path: str | None, shown: dict | None, navigated: bool, on_screen: bool, log_shown: bool) -> dict:
        return refresh(backend, view, path, shown, visible=on_screen, log_open=log_shown, open_tab=not navigated)

    # the page's first look skips the queue (one plain request: the page is shown sooner); only
    # it may open this tab. Later looks: when the page's run changes, and when the feed asks.
    look = dict(fn=tick, inputs=[run_state, seen, navigated, visible, log_open], outputs=view.outputs(),
                js=TICK_JS, show_progress="hidden", concurrency_limit=None, api_visibility="private")
    page.load(**look, queue=False).then(None, inputs=open_train, js=AFTER_TICK_JS, api_visibility="private",
                                        show_progress="hidden")
    look_button.click(**look, queue=True)
    run_state.change(**look, queue=True)

    def start_confirmed(given: dict) -> dict:
        if not given[confirmed]:
            gr.Info("Not started: the run going on is left as it is.")
            return {tabs: gr.update()}  # (an empty dict reads as one missing value to Gradio)
        return start_run(backend, configure.values(given), run_state, tabs)

    start.click(None, outputs=confirmed, js=CONFIRM_START_JS, api_visibility="private").then(
        readable(start_confirmed), inputs={confirmed, *configure.inputs}, outputs=[run_state, tabs],
        api_visibility="private")

    def act(what: str):
        def handler(path: str | None, new_lr: float | None = None, ok: bool = True) -> None:
            _act(backend, what, path, new_lr, ok)
        return readable(handler)

    for name in ("pause", "resume", "save", "evaluate", "stop", "stop_other"):
        buttons[name].click(act(name), inputs=run_state, outputs=None, concurrency_limit=None,
                            api_visibility="private")
    buttons["set_lr"].click(None, inputs=lr, outputs=confirmed, js=CONFIRM_LR_JS, api_visibility="private").then(
        act("set_lr"), inputs=[run_state, lr, confirmed], outputs=None, concurrency_limit=None,
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
    log: gr.Code
    lr: gr.Textbox
    buttons: dict[str, gr.Button]
    start: gr.Button | None = None
    chat_note: gr.Markdown | None = None  # the side chat's note on the embedded default
    marker: gr.HTML | None = None         # the run and state this look saw, for the feed
    role_of: Callable[[], Role] = lambda: Role.OPERATOR  # whom the look is for (app.web.access)

    def outputs(self) -> list:
        extra = [c for c in (self.start, self.chat_note, self.marker) if c is not None]
        return [self.run_state, self.seen, self.open_train, self.status, self.banner, self.log,
                *self.buttons.values(), *extra]

    def controls(self, state: str | None) -> dict:
        """Each button enabled when the run's state allows its command; Resume is the primary
        button of a paused run, and Start is not primary while a run is live. A viewer's login
        (`role_of`) gets them all disabled: each would be refused."""
        ok = allowed(state, self.role_of())
        out = {button: gr.update(interactive=COMMAND_OF[name] in ok) for name, button in self.buttons.items()}
        out[self.buttons["resume"]] = gr.update(interactive="resume" in ok,
                                                variant="primary" if state == RunState.PAUSED else "secondary")
        if self.start is not None:
            out[self.start] = gr.update(variant="secondary" if state in LIVE_STATES else "primary")
        return out


def refresh(backend: Backend, view: TrainView, path: str | None, shown: dict | None, visible: bool = True,
            log_open: bool = False, open_tab: bool = True) -> dict:
    """One look at the run: only what changed since what the page was `shown`, and while the
    tab is hidden (`visible` False) only the run it shows (the feed's marker), except on the
    page's first look, which also asks the page to open the Train tab when the run is going.
    `shown` is what was sent: {"path", "version" (of the run's view), "state", "status",
    "marker"}; None on the first look. The plots and the side chat's header are the live feed's
    (feed.py)."""
    first_tick = shown is None
    path = path or backend.session.default_run()
    if not shown or shown.get("path") != path:
        shown = {"path": path, "version": -1, "state": "", "status": ""}
    sent = dict(shown)
    if not visible and not first_tick:
        return {view.run_state: path, **_marked(view, sent, path, False), view.seen: sent}
    if path is None:
        out = {view.run_state: None, view.open_train: False}
        return {**out, **_changed(view, sent, None, status_html(None)), view.seen: sent}
    try:
        snap = backend.watch.snapshot(path)
    except SessionError as e:
        out = {view.run_state: path, view.open_train: False}
        return {**out, **_changed(view, sent, None, status_html(None, str(e))), view.seen: sent}
    out = {view.run_state: path, view.open_train: first_tick and open_tab and snap.info.alive}
    if not visible:
        return {**out, **_marked(view, sent, path, False), view.seen: sent}
    out.update(_changed(view, sent, snap.info.state, status_html(snap), path))
    text = banner_html(snap.failure, backend.session.stop_error(path))
    if text or sent.get("banner"):
        out[view.banner] = gr.update(value=text, visible=bool(text))
        sent["banner"] = bool(text)
    if view.chat_note is not None and sent.get("chat_note") != path:  # the side chat's note, once per run
        out[view.chat_note] = chat_side.note_update(backend, path)
        sent["chat_note"] = path
    if log_open and (snap.version != shown["version"] or not shown.get("log")):
        out[view.log] = backend.watch.log_tail(path)
        sent["log"] = True
    sent["version"] = snap.version
    return {**out, view.seen: sent}


def _marked(view: TrainView, sent: dict, path: str | None, state: str | None | bool) -> dict:
    """The feed's marker, when the run or its state differ from what it says (`sent` updated).
    `state` False: not looked at (a hidden tab), so only another run changes the marker."""
    if state is False:
        if "marker" in sent and sent["marker"][0] == path:
            return {}
        state = None
    if view.marker is None or sent.get("marker") == [path, state]:
        return {}
    sent["marker"] = [path, state]
    return {view.marker: feed.marker_html(path, state)}


def _changed(view: TrainView, sent: dict, state: str | None, status: str, path: str | None = None) -> dict:
    """The status line, the buttons and the feed's marker, when they differ from what the page
    shows (`sent` is updated)."""
    out: dict = _marked(view, sent, path, state)
    if status != sent.get("status"):
        out[view.status] = status
        sent["status"] = status
    if state != sent.get("state"):
        out.update(view.controls(state))
        sent["state"] = state
    return out


def _act(backend: Backend, what: str, path: str | None, new_lr: Any = None, confirmed: bool = True) -> None:
    session = backend.session
    if what in ("stop", "stop_other"):
        save = Stop().save if what == "stop" else OTHER_SAVE
        info = session.stop(path, save=save)
        # closed by the page once the run shows finished (AFTER_TICK_JS)
        gr.Info(f"Stopping {info.name}{' (saving first)' if save else ''} ...", duration=60)
        return
    if what == "set_lr":
        result = backend.verbs(path).send(lr_from_box(new_lr, confirmed))  # the one box rule (app.lr_box)
        gr.Info(f"Learning rate set to {result.changes['lr']:.3g} at step {result.step}")
        return
    verbs = backend.verbs(path)
    result = {"pause": verbs.pause, "resume": verbs.resume, "save": verbs.save, "evaluate": verbs.evaluate}[what]()
    step = result.step
    messages = {"pause": f"Paused at step {step}; the model stays in memory (chat still works).",
                "resume": f"Resumed at step {step}.",
                "save": f"Saved a checkpoint at step {step}: {getattr(result, 'checkpoint', None)}",
                "evaluate": f"Evaluated at step {step}: " + ", ".join(
                    f"{k} {v:.4g}" for k, v in (getattr(result, "metrics", None) or {}).items())}
    gr.Info(messages[what])
