"""The run panel's branch and data controls, as in the web app: the branch
tree, Rewind / Branch from any branch's checkpoint or a kept snapshot, Snapshot now; the
training sources with their weights and samples drawn, a weight set live, a source added or
removed, the inbox of taught answers and preferences (rejected answer, margin before and
after) with Remove; every other live setting (optimizer, clipping, intervals, preference beta,
serving budget). They read the run folder (`app.branches`,
`app.sources`) and send through the panel's command thread (`RunPanel._command`), so the kernel
never waits for a step boundary; each control is enabled when the run's state allows its command.
"""

from __future__ import annotations

import html
from concurrent.futures import Future
from typing import Any, Callable

import ipywidgets as widgets

from app import live_settings
from app.branches import branch_view, tree_lines
from app.notebook.api import Run
from app.session import SessionError, allowed
from app.sources import INBOX_COLUMNS, data_view, inbox_rows, number
from contract.run_folder import RunFolder
from contract.protocol.states import RunState

Send = Callable[[str, Callable[[Run], Any]], "Future | None"]


def _button(label: str, icon: str, action: Callable[[], Any], width: str = "150px") -> widgets.Button:
    b = widgets.Button(description=label, icon=icon, layout=widgets.Layout(width=width))
    b.on_click(lambda _: action())
    return b


class BranchControls:
    """The branch tree and Rewind / Branch / Snapshot."""

    def __init__(self, get_run: Callable[[], Run | None], send: Send, on_error: Callable[[str], None]):
        self._get_run, self._send, self._error = get_run, send, on_error
        self.tree = widgets.HTML()
        self.target = widgets.Dropdown(description="from", layout=widgets.Layout(width="460px"))
        self.rewind_button = _button("Rewind to it", "undo", self.rewind)
        self.name = widgets.Text(description="branch", placeholder="new branch name",
                                 layout=widgets.Layout(width="260px"))
        self.lr = widgets.Text(description="lr", placeholder="empty: as it was", layout=widgets.Layout(width="200px"))
        self.branch_button = _button("Branch from it", "code-fork", self.branch)
        self.snapshot_button = _button("Snapshot now", "camera", self.snapshot)
        self.refresh_button = _button("Refresh", "refresh", self.refresh, "100px")
        self.widget = widgets.VBox([
            widgets.HTML("<b>Branches</b>"), self.tree,
            widgets.HBox([self.target, self.rewind_button]),
            widgets.HBox([self.name, self.lr, self.branch_button]),
            widgets.HBox([self.snapshot_button, self.refresh_button])])

    def refresh(self, state: str | None = None) -> None:
        run = self._get_run()
        if run is None:
            self.tree.value, self.target.options = "<i>no run</i>", []
            self.enable(None)
            return
        view = branch_view(RunFolder(run.path))
        self.tree.value = "<pre style='margin:0'>" + html.escape("\n".join(tree_lines(view))) + "</pre>"
        self.target.options = [(t.label, t.value) for t in view.targets]
        self.enable(state if state is not None else run.info().state)

    def enable(self, state: str | None) -> None:
        ok = allowed(state)
        self.rewind_button.disabled = "rewind" not in ok
        self.branch_button.disabled = "branch" not in ok
        self.snapshot_button.disabled = "snapshot" not in ok

    def _after(self, future: Future | None) -> Future | None:
        if future is not None:
            future.add_done_callback(lambda _: self.refresh())
        return future

    def rewind(self) -> Future | None:
        target = self.target.value
        if not target:
            self._error("rewind: pick a checkpoint or snapshot first")
            return None
        return self._after(self._send("rewind", lambda run: run.rewind(target)))

    def branch(self) -> Future | None:
        target, name, lr = self.target.value, self.name.value.strip(), self.lr.value.strip()
        if not target or not name:
            self._error("branch: pick a checkpoint or snapshot and name the new branch")
            return None
        try:
            settings = {"lr": number(lr, "branch: the learning rate")} if lr else {}
        except ValueError as e:
            self._error(str(e))
            return None
        return self._after(self._send("branch", lambda run: run.branch(target, name, **settings)))

    def snapshot(self) -> Future | None:
        return self._after(self._send("snapshot", lambda run: run.snapshot()))


class DataControls:
    """The sources, their weights and samples drawn; add / set weight / remove; the inbox."""

    def __init__(self, get_run: Callable[[], Run | None], send: Send, on_error: Callable[[str], None]):
        self._get_run, self._send, self._error = get_run, send, on_error
        self.sources = widgets.HTML()
        self.source = widgets.Dropdown(description="source", layout=widgets.Layout(width="300px"))
        self.weight = widgets.Text(description="weight", placeholder="0 pauses it", layout=widgets.Layout(width="200px"))
        self.weight_button = _button("Set weight", "balance-scale", self.set_weight)
        self.remove_button = _button("Remove source", "trash", self.remove)
        self.path = widgets.Text(description="add", placeholder="file or folder", layout=widgets.Layout(width="420px"))
        self.format = widgets.Dropdown(options=["auto", "text", "input_output", "chat", "tokenized"],
                                       value="auto", layout=widgets.Layout(width="130px"))
        self.add_weight = widgets.Text(value="1.0", description="weight", layout=widgets.Layout(width="160px"))
        self.add_button = _button("Add source", "plus", self.add)
        self.inbox = widgets.HTML()
        self.entry = widgets.Dropdown(description="entry", layout=widgets.Layout(width="420px"))
        self.forget_button = _button("Remove from inbox", "times", self.forget, "170px")
        self.refresh_button = _button("Refresh", "refresh", self.refresh, "100px")
        self.widget = widgets.VBox([
            widgets.HTML("<b>Data</b>"), self.sources,
            widgets.HBox([self.source, self.weight, self.weight_button, self.remove_button]),
            widgets.HBox([self.path, self.format, self.add_weight, self.add_button]),
            widgets.HTML("<b>Inbox</b> (answers taught and preferences given from the chat)"), self.inbox,
            widgets.HBox([self.entry, self.forget_button, self.refresh_button])])

    def refresh(self, state: str | None = None) -> None:
        run = self._get_run()
        if run is None:
            self.sources.value, self.inbox.value = "<i>no run</i>", ""
            self.enable(None)
            return
        live = None
        if run.info().alive and run.info().state in (RunState.RUNNING, RunState.PAUSED):
            try:
                live = run.status().sources
            except Exception:  # noqa: BLE001 - the event log's account is shown instead
                live = None
        view = data_view(RunFolder(run.path), live_sources=live if isinstance(live, list) else None)
        self.sources.value = _table(["source", "weight", "samples drawn", "path"],
                                    [[s.get("name"), s.get("weight"), s.get("seen", 0), s.get("path")]
                                     for s in view.sources])
        self.source.options = [str(s.get("name")) for s in view.sources]
        self.inbox.value = _table(INBOX_COLUMNS, inbox_rows(view.inbox))  # the web app's columns
        self.entry.options = [(f"{e['id']}: {e['answer']}" + (f" over {e['rejected']}" if e.get("rejected") else ""),
                               e["id"]) for e in view.inbox if not e["removed"]]
        self.enable(state if state is not None else run.info().state)

    def enable(self, state: str | None) -> None:
        ok = allowed(state)
        for button, command in ((self.weight_button, "set_weight"), (self.remove_button, "remove_source"),
                                (self.add_button, "add_source"), (self.forget_button, "forget")):
            button.disabled = command not in ok

    def _after(self, future: Future | None) -> Future | None:
        if future is not None:
            future.add_done_callback(lambda _: self.refresh())
        return future

    def set_weight(self) -> Future | None:
        source = self.source.value
        try:
            weight = number(self.weight.value, "set weight: the weight")
        except ValueError as e:
            self._error(str(e))
            return None
        if not source:
            self._error("set weight: pick a source first")
            return None
        return self._after(self._send("set weight", lambda run: run.set_weight(source, weight)))

    def remove(self) -> Future | None:
        source = self.source.value
        if not source:
            self._error("remove source: pick a source first")
            return None
        return self._after(self._send("remove source", lambda run: run.remove_source(source)))

    def add(self) -> Future | None:
        path, fmt = self.path.value.strip(), self.format.value
        try:
            weight = number(self.add_weight.value, "add source: the weight")
        except ValueError as e:
            self._error(str(e))
            return None
        if not path:
            self._error("add source: type the path of a file or folder")
            return None
        return self._after(self._send("add source", lambda run: run.add_source(path, weight=weight, format=fmt)))

    def forget(self) -> Future | None:
        entry = self.entry.value
        if not entry:
            self._error("remove from inbox: pick an entry first")
            return None
        return self._after(self._send("remove from inbox", lambda run: run.forget(entry)))


class SettingsControls:
    """Every other live setting of `set` (app.live_settings: the command's fields but the
    learning rate, which has its own box, and the chat's generation defaults): a box each, Apply
    sends the filled ones as one `set`, and the run's present values are shown after it."""

    def __init__(self, get_run: Callable[[], Run | None], send: Send, on_error: Callable[[str], None]):
        self._get_run, self._send, self._error = get_run, send, on_error
        self.present = widgets.HTML()
        self.boxes = {name: widgets.Text(value="", description=live_settings.label(name),
                                         placeholder=_short(live_settings.help_text(name)),
                                         description_tooltip=live_settings.help_text(name),
                                         style={"description_width": "150px"}, layout=widgets.Layout(width="460px"))
                      for name in live_settings.names()}
        self.apply_button = _button("Apply", "sliders", self.apply, "120px")
        self.refresh_button = _button("Refresh", "refresh", self.refresh, "100px")
        self.widget = widgets.VBox([self.present, *self.boxes.values(),
                                    widgets.HBox([self.apply_button, self.refresh_button])])

    def refresh(self, state: str | None = None) -> None:
        run = self._get_run()
        settings = None
        if run is not None and run.info().alive and run.info().state in (RunState.RUNNING, RunState.PAUSED):
            try:
                settings = run.status().settings
            except Exception:  # noqa: BLE001 - nothing to show now; the next refresh tries again
                settings = None
        shown = live_settings.present(settings)
        self.present.value = ("now: " + " · ".join(f"{html.escape(k)} <b>{html.escape(v)}</b>" for k, v in shown)
                              if shown else "<i>no live values to show</i>")
        self.enable(state if state is not None else (run.info().state if run is not None else None))

    def enable(self, state: str | None) -> None:
        self.apply_button.disabled = "set" not in allowed(state)

    def apply(self) -> Future | None:
        try:
            changes = live_settings.changes({name: box.value for name, box in self.boxes.items()})
        except SessionError as e:
            self._error(f"set: {e}")
            return None
        for box in self.boxes.values():
            box.value = ""
        future = self._send("set", lambda run: run.set(**changes))
        if future is not None:
            future.add_done_callback(lambda _: self.refresh())
        return future


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _table(head: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return "<i>none yet</i>"
    cells = "".join("<tr>" + "".join(f"<td style='padding:0 8px'>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                    for row in rows)
    heads = "".join(f"<th style='padding:0 8px;text-align:left'>{html.escape(h)}</th>" for h in head)
    return f"<table style='font-size:90%'><tr>{heads}</tr>{cells}</table>"
