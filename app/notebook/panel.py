"""The run panel: config form, Start / Pause / Resume / Stop / Save / Evaluate, a live learning
rate, progress with ETA, live plots, the chat box (with Teach), the branches (Rewind / Branch /
Snapshot), data (sources, weights, inbox) and other live settings folds of `extras`, and a run
picker to reattach.

    panel = RunPanel()       # reattaches to the newest live run in the output folder, if any
    panel                    # (last line of a cell) shows it

The panel only lays widgets out and wires them to `app.notebook.api` (the run manager and client
every front end shares). Nothing blocks the kernel: a background thread follows the run's event
log and redraws, commands run one after another on a worker thread (each waits for the run's
next step boundary), and the chat streams from a thread of its own.
"""

from __future__ import annotations

import html
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import ipywidgets as widgets

from app.notebook import api
from app.notebook.chat import ChatBox
from app.notebook.extras import BranchControls, DataControls, SettingsControls
from app.notebook.fallback import with_note
from app.notebook.form import ConfigForm
from app.notebook.plots import render_png
from app.notebook.samples import SamplesControls
from app.notebook.watch import Watcher
from app.series import RunHistory, format_seconds
from app.lr_box import lr_from_box
from app.session import SessionError, allowed
from contract.config.schema import ConfigError
from contract.protocol.commands import Stop
from contract.protocol.states import RunState
from supervisor import RunInfo

_MESSAGES_SHOWN = 6


class RunPanel:
    """Widgets over one run at a time; `run` is the one shown (None before Start or attach)."""

    def __init__(self, output_dir: str | Path | None = None, form: ConfigForm | None = None,
                 attach_live: bool = True, poll_interval: float = 0.5, plot_interval: float = 2.0):
        self.output_dir = output_dir
        folder = Path(output_dir) if output_dir is not None else api.default_output_dir()
        self.form = form or ConfigForm(output_dir=str(folder.resolve()))
        self.run: api.Run | None = None
        self.watcher: Watcher | None = None
        self.poll_interval, self.plot_interval = poll_interval, plot_interval
        self.messages: list[tuple[str, bool]] = []   # (text, is_error), oldest first
        self.plots_drawn = 0
        self._lock = threading.Lock()
        self._commands = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-commands")
        self._futures: list[Future] = []
        self._plotted_version, self._plotted_at = -1, 0.0
        self._build_widgets()
        self.refresh_runs()
        if attach_live:
            live = [info for info in api.runs(output_dir) if info.alive]
            if live:
                self.attach(live[0].name)
        self._update_buttons(None)

    # -- layout ---------------------------------------------------------------------------------
    def _build_widgets(self) -> None:
        def button(label: str, icon: str, action: Callable[[], Any], style: str = "") -> widgets.Button:
            b = widgets.Button(description=label, icon=icon, button_style=style,
                               layout=widgets.Layout(width="105px"))
            b.on_click(lambda _: action())
            return b

        self.start_button = button("Start", "play", self.start, "success")
        self.pause_button = button("Pause", "pause", self.pause)
        self.resume_button = button("Resume", "play-circle", self.resume)
        self.stop_button = button("Stop", "stop", self.stop, "danger")
        self.save_button = button("Save", "save", self.save)
        self.evaluate_button = button("Evaluate", "check", self.evaluate)
        self.save_on_stop = widgets.Checkbox(value=Stop().save, description="save on stop", indent=False,
                                             layout=widgets.Layout(width="120px"))
        # empty until typed in (a number shown there would be sent by Set as it is); its
        # placeholder follows the run's present rate (`_on_tick`), as the progress line does
        self.lr = widgets.Text(value="", description="new learning rate", placeholder="e.g. 0.001",
                               style={"description_width": "initial"}, layout=widgets.Layout(width="340px"))
        self.lr_button = button("Set lr", "sliders", self.set_lr)
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="progress",
                                            layout=widgets.Layout(width="420px"))
        self.progress_label = widgets.HTML()
        self.plot = widgets.Image(format="png", layout=widgets.Layout(width="960px"))
        self.chat = ChatBox(lambda: self.run, on_error=self._error)
        self.branches = BranchControls(lambda: self.run, self._command, self._error)
        self.data = DataControls(lambda: self.run, self._command, self._error)
        self.settings = SettingsControls(lambda: self.run, self._command, self._error)
        self.samples = SamplesControls(lambda: self.run, self._command, self._error, lambda: self.history)
        extras = widgets.Accordion(children=[self.branches.widget, self.data.widget, self.settings.widget,
                                             self.samples.widget],
                                   titles=("branches: rewind, branch, snapshot", "data: sources, weights, inbox",
                                           "more live settings: optimizer, clipping, intervals, beta, serving",
                                           "samples (GRPO): the latest answers, their rewards; rate one"))
        self.picker = widgets.Dropdown(description="run", layout=widgets.Layout(width="520px"))
        self.refresh_button = button("Refresh", "refresh", self.refresh_runs)
        self.attach_button = button("Attach", "link", lambda: self.picker.value and self.attach(self.picker.value))
        self.status = widgets.HTML()
        form_box = widgets.Accordion(children=[self.form.widget], titles=("run config",), selected_index=0)
        self.widget = widgets.VBox([
            form_box,
            widgets.HBox([self.start_button, self.pause_button, self.resume_button, self.stop_button,
                          self.save_on_stop, self.save_button, self.evaluate_button]),
            widgets.HBox([self.lr, self.lr_button]),
            widgets.HBox([self.progress, self.progress_label]),
            self.plot, self.chat.widget, extras,
            widgets.HBox([self.picker, self.refresh_button, self.attach_button]),
            self.status])

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return with_note(self.widget._repr_mimebundle_(**kwargs), "panel")

    # -- runs -----------------------------------------------------------------------------------
    def start(self) -> api.Run | None:
        """Start a run of the form's config and show it; None (problems shown) if it is invalid."""
        try:
            cfg = self.form.config()
        except ConfigError as e:
            self.form.validate()
            self._error(str(e))
            return None
        try:
            run = api.start(cfg, output_dir=self.output_dir)
        except (ConfigError, api.RunError, OSError) as e:
            self._error(f"start: {e}")
            return None
        self._say(f"started {run.name}")
        return self.attach(run)

    def attach(self, run: api.Run | str) -> api.Run:
        """Show `run` (a Run or a run's name), its whole history first, then live."""
        if isinstance(run, str):
            run = api.attach(run, self.output_dir)
        self.detach()
        self.run = run
        self._plotted_version = -1
        self.lr.placeholder = "e.g. 0.001"
        self.chat.clear()
        self._update_buttons(run.info().state)
        self.watcher = Watcher(run.handle.folder, self._on_tick, is_alive=lambda: run.info().alive,
                               interval=self.poll_interval, on_error=self._error).start()
        self.refresh_runs(select=run.name)
        self.branches.refresh()
        self.data.refresh()
        self.settings.refresh()
        self.samples.refresh()
        return run

    def detach(self) -> None:
        """Stop showing the current run (it goes on; its connection is the session's, shared
        with every other panel and call in this kernel)."""
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        self.run = None

    def refresh_runs(self, select: str | None = None) -> list[RunInfo]:
        """Fill the run picker from the output folder."""
        infos = api.runs(self.output_dir)
        current = select or self.picker.value
        self.picker.options = [(_run_label(i), i.name) for i in infos]
        names = [i.name for i in infos]
        if current in names:
            self.picker.value = current
        return infos

    @property
    def history(self) -> RunHistory | None:
        return self.watcher.history if self.watcher is not None else None

    # -- commands -------------------------------------------------------------------------------
    def pause(self) -> Future | None:
        return self._command("pause", lambda run: run.pause())

    def resume(self) -> Future | None:
        return self._command("resume", lambda run: run.resume())

    def stop(self) -> Future | None:
        save = self.save_on_stop.value
        return self._command("stop", lambda run: run.stop(save=save))

    def save(self) -> Future | None:
        return self._command("save", lambda run: run.save())

    def evaluate(self) -> Future | None:
        return self._command("evaluate", lambda run: run.evaluate())

    def set_lr(self) -> Future | None:
        """Send the box's learning rate and empty the box (its placeholder shows the present
        rate again). The box's rule is the web page's (app.lr_box: the Set command's bounds; 0
        stops learning, which a panel cannot confirm, so from code `run.set(lr=0)` does it)."""
        try:
            command = lr_from_box(self.lr.value)
        except SessionError as e:
            self._error(str(e))
            return None
        self.lr.value = ""
        return self._command("set lr", lambda run: run.set(lr=command.lr))

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until every command sent so far has been answered."""
        with self._lock:
            futures = list(self._futures)
        wait(futures, timeout=timeout)

    def _command(self, label: str, call: Callable[[api.Run], Any]) -> Future | None:
        run = self.run
        if run is None:
            self._error(f"{label}: no run is attached")
            return None

        def work() -> Any:
            try:
                result = call(run)
            except Exception as e:  # noqa: BLE001 - shown in the panel; the future carries it too
                self._error(f"{label}: {e}")
                raise
            self._say(f"{label}: {_brief(result)}")
            return result

        future = self._commands.submit(work)
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [future]
        return future

    # -- redrawing (the watcher's thread) -------------------------------------------------------
    def _on_tick(self, history: RunHistory, changed: bool) -> None:
        s = history.summary
        if s.total_steps:
            self.progress.max = s.total_steps
            self.progress.value = min(s.step, s.total_steps)
        self.progress_label.value = _progress_text(history)
        lr = history.latest("lr")
        if lr is not None and self.lr.placeholder != (now := lr_placeholder(lr)):
            self.lr.placeholder = now
        due = time.monotonic() - self._plotted_at >= self.plot_interval or s.final
        if history.version != self._plotted_version and due:
            self._plotted_version = history.version
            self.plot.value = render_png(history)
            self._plotted_at = time.monotonic()
            self.plots_drawn += 1
        self.samples.show(history)
        if changed:
            self._update_buttons(s.state)
            if s.final:
                self.refresh_runs()

    def _update_buttons(self, state: str | None) -> None:
        """Each button enabled when the run's state allows its command (the contract's table,
        as in the web app); Start while no run is live."""
        ok = allowed(state)
        self.start_button.disabled = state is not None and RunState(state).live
        for button, command in ((self.pause_button, "pause"), (self.resume_button, "resume"),
                                (self.stop_button, "stop"), (self.save_button, "save"),
                                (self.evaluate_button, "evaluate"), (self.lr_button, "set")):
            button.disabled = command not in ok
        self.chat.set_enabled("generate" in ok)
        self.chat.teach_button.disabled = "teach" not in ok
        self.branches.enable(state)
        self.data.enable(state)
        self.settings.enable(state)
        self.samples.enable(state)

    # -- messages -------------------------------------------------------------------------------
    def _say(self, text: str, error: bool = False) -> None:
        with self._lock:
            self.messages.append((text, error))
            shown = self.messages[-_MESSAGES_SHOWN:]
        self.status.value = "".join(
            f"<div style='{'color:#b00020' if is_error else 'color:#333'};font-size:90%;"
            f"white-space:pre-wrap'>{html.escape(t)}</div>" for t, is_error in shown)

    def _error(self, text: str) -> None:
        self._say(text, error=True)

    def close(self) -> None:
        """Stop following the run and drop the widgets' threads (the run goes on)."""
        self.detach()
        self._commands.shutdown(wait=False)


def lr_placeholder(lr: float) -> str:
    """The learning-rate box's placeholder: the run's present rate, written as the progress line
    writes it."""
    return f"now {lr:.2e}"


def _run_label(info: RunInfo) -> str:
    total = info.total_steps if info.total_steps is not None else "?"
    gone = "" if info.alive or RunState(info.state).final else ", gone"
    return f"{info.name}  [{info.state}{gone}] step {info.step}/{total}"


def _progress_text(history: RunHistory) -> str:
    s = history.summary
    parts = [f"<b>{html.escape(s.state or 'waiting')}</b>", f"step {s.step}/{s.total_steps or '?'}"]
    for name, fmt in (("loss", "loss {:.4f}"), ("lr", "lr {:.2e}"), ("tokens_per_s", "{:.0f} tok/s"),
                      ("mem_mb", "{:.0f} MiB")):
        value = history.latest(name)
        if value is not None:
            parts.append(fmt.format(value))
    for name, points in sorted(history.eval.items()):
        parts.append(f"eval/{name} {points[-1][1]:.4g}")
    if not s.final:
        parts.append(f"ETA {format_seconds(history.eta())}")
    text = " · ".join(parts)
    if s.error:
        text += f"<div style='color:#b00020'>{html.escape(s.error)}</div>"
    return text


def _brief(result: Any) -> str:
    if isinstance(result, RunInfo):
        return f"{result.state} at step {result.step}"
    text = json.dumps(result, default=str)
    return text if len(text) <= 300 else text[:297] + "..."
