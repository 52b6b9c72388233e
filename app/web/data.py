"""The Train tab's data panel: the run's sources with their weights and the samples
drawn from each (a table and a plot), a weight changed live, a source added or removed at the
next step boundary, and the inbox of answers taught from the Chat tab (with the engine's check:
the answer before and after; a preference's rejected answer and its margin before and after),
where an entry can be removed. Read from the run folder
(`app.sources`); the commands go through `Session.command` by wire name (`add_source`,
`set_weight`, `remove_source`, `forget`), so the engine's validation messages (a bad file by
row, a negative weight) are the ones shown, and nothing changes when it refuses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from app.session import SessionError, allowed
from app.sources import INBOX_COLUMNS, DataView, data_view, inbox_rows, number, readable_prompt
from app.web.access import OPERATOR
from app.web.backend import Backend
from app.web.plots import batch, live_plot
from app.web.widgets import TABLE_CLASS
from contract.run_folder import RunFolder
from contract.protocol.roles import Role
from contract.protocol.states import RunState

SOURCE_COLUMNS = ["source", "weight", "samples drawn", "format", "path"]
# each inbox column's share of the table's width (short headers that never break inside a word:
# TABLE_CLASS); a taught answer fills "answer (chosen)", a preference also "rejected"
INBOX_WIDTHS = dict(zip(INBOX_COLUMNS, ["4%", "15%", "13%", "11%", "5%", "11%", "11%", "7%", "16%", "7%"]))
INBOX_LABEL = ("Inbox: answers taught and preferences given from the Chat tab. step: when it was taught; "
               "before / after: the model's answer then and at the check; learned: for an answer, the answer "
               "after is the taught one; for a pair, the model prefers the chosen answer at the check (its margin "
               "log p(chosen) − log p(rejected) is above 0); margin: before → after")
FORMATS = ["auto", "text", "input_output", "chat", "tokenized"]


@dataclass
class DataPanel:
    sources: gr.Dataframe
    source: gr.Dropdown
    weight: gr.Textbox
    set_weight: gr.Button
    remove: gr.Button
    path: gr.Textbox
    fmt: gr.Dropdown
    new_weight: gr.Textbox
    new_name: gr.Textbox
    add: gr.Button
    seen: gr.HTML
    inbox: gr.Dataframe
    entry: gr.Dropdown
    forget: gr.Button
    refresh: gr.Button
    result: gr.Markdown

    def outputs(self) -> list:
        return [self.sources, self.source, self.set_weight, self.remove, self.add, self.seen, self.inbox,
                self.entry, self.forget]


def build(backend: Backend, run_state: gr.State) -> DataPanel:
    with gr.Accordion("Data: sources, weights, samples drawn; taught answers (inbox)", open=False,
                      elem_id="data-fold") as fold:
        sources = gr.Dataframe(pd.DataFrame(columns=SOURCE_COLUMNS), interactive=False, elem_id="data-sources",
                               wrap=True, max_height=240)
        with gr.Row(equal_height=True):
            source = gr.Dropdown([], label="Source", scale=2, elem_id="data-source")
            weight = gr.Textbox(label="New weight (0 pauses it)", max_lines=1, scale=1, elem_id="data-weight")
            set_weight = gr.Button("Set weight", interactive=False, scale=1, elem_id="data-set-weight", elem_classes=[OPERATOR])
            remove = gr.Button("Remove source", interactive=False, variant="stop", scale=1, elem_id="data-remove", elem_classes=[OPERATOR])
        with gr.Row(equal_height=True):
            path = gr.Textbox(label="Add a source: file or folder", max_lines=1, scale=3, elem_id="data-path",
                              placeholder="e.g. /data/extra.jsonl (checked row by row before it is used)")
            fmt = gr.Dropdown(FORMATS, value="auto", label="Format", scale=1, elem_id="data-format")
            new_weight = gr.Textbox("1.0", label="Weight", max_lines=1, scale=1, elem_id="data-new-weight")
            new_name = gr.Textbox(label="Name (optional)", max_lines=1, scale=1, elem_id="data-new-name")
            add = gr.Button("Add source", interactive=False, scale=1, elem_id="data-add", elem_classes=[OPERATOR])
        seen = live_plot("seen", "data-plot-seen")
        inbox = gr.Dataframe(pd.DataFrame(columns=INBOX_COLUMNS), interactive=False, elem_id="data-inbox",
                             wrap=True, max_height=260, label=INBOX_LABEL, column_widths=list(INBOX_WIDTHS.values()),
                             elem_classes=[TABLE_CLASS])
        with gr.Row(equal_height=True):
            entry = gr.Dropdown([], label="Inbox entry", scale=3, elem_id="data-entry")
            forget = gr.Button("Remove from the inbox", interactive=False, scale=1, elem_id="data-forget", elem_classes=[OPERATOR])
            refresh = gr.Button("Refresh", scale=1, elem_id="data-refresh")
        result = gr.Markdown("", elem_id="data-result")
    panel = DataPanel(sources, source, weight, set_weight, remove, path, fmt, new_weight, new_name, add, seen,
                      inbox, entry, forget, refresh, result)
    outputs = [result, *panel.outputs()]
    look: dict[str, Any] = dict(fn=lambda p: show(backend, panel, p), inputs=run_state, outputs=panel.outputs(),
                                api_visibility="private", show_progress="hidden")
    refresh.click(**look)
    fold.expand(**look)
    act: dict[str, Any] = dict(outputs=outputs, api_visibility="private", concurrency_limit=None)
    set_weight.click(_handler(lambda p, s, w: do_set_weight(backend, panel, p, s, w)),
                     inputs=[run_state, source, weight], **act)
    remove.click(_handler(lambda p, s: do_remove(backend, panel, p, s)), inputs=[run_state, source], **act)
    add.click(_handler(lambda p, f, k, w, n: do_add(backend, panel, p, f, k, w, n)),
              inputs=[run_state, path, fmt, new_weight, new_name], **act)
    forget.click(_handler(lambda p, e: do_forget(backend, panel, p, e)), inputs=[run_state, entry], **act)
    return panel


def _handler(fn):
    def run(*args: Any) -> dict:
        try:
            return fn(*args)
        except (SessionError, ValueError) as e:
            raise gr.Error(str(e), print_exception=False) from None
    return run


def show(backend: Backend, panel: DataPanel, path: str | None, seq: int = 1) -> dict:
    """One look at the run's data: the tables, the choices, the buttons its state allows, the plot."""
    try:
        path = backend.session.resolve(path)
    except SessionError:
        return {panel.sources: pd.DataFrame(columns=SOURCE_COLUMNS), panel.inbox: pd.DataFrame(columns=INBOX_COLUMNS),
                panel.source: gr.update(choices=[], value=None), panel.entry: gr.update(choices=[], value=None),
                **_buttons(panel, None), panel.seen: batch({}, None, "", seq)}
    view = data_view(RunFolder(Path(path)), live_sources=live_sources(backend, path))
    names = [str(s.get("name")) for s in view.sources]
    entries = [(entry_label(e), e["id"]) for e in view.inbox if not e.get("removed")]
    return {panel.sources: _sources_frame(view), panel.inbox: _inbox_frame(view),
            panel.source: gr.update(choices=names, value=names[0] if names else None),
            panel.entry: gr.update(choices=entries, value=entries[-1][1] if entries else None),
            **_buttons(panel, backend.session.info(path).state, backend.session.role_of()), panel.seen: batch(view.seen, None, path, seq)}


def live_sources(backend: Backend, path: str) -> list[dict] | None:
    """The sources as the running run says now (a rewind takes them back with the data position);
    None when it cannot say (not running, or no answer at once)."""
    info = backend.session.info(path)
    if not info.alive or info.state not in (RunState.RUNNING, RunState.PAUSED):
        return None
    try:
        found = backend.session.client(path, timeout=2.0).status().sources
    except Exception:  # noqa: BLE001 - the event log's account is shown instead
        return None
    return found if isinstance(found, list) else None


def _buttons(panel: DataPanel, state: str | None, role: Role = Role.OPERATOR) -> dict:
    ok = allowed(state, role)  # a viewer's login: all off
    return {panel.set_weight: gr.update(interactive="set_weight" in ok), panel.remove: gr.update(interactive="remove_source" in ok),
            panel.add: gr.update(interactive="add_source" in ok), panel.forget: gr.update(interactive="forget" in ok)}


def _sources_frame(view: DataView) -> pd.DataFrame:
    rows = [[s.get("name"), s.get("weight"), s.get("seen", 0), s.get("format", ""), s.get("path", "")]
            for s in view.sources]
    return pd.DataFrame(rows, columns=SOURCE_COLUMNS)


def _inbox_frame(view: DataView) -> pd.DataFrame:
    return pd.DataFrame(inbox_rows(view.inbox), columns=INBOX_COLUMNS)


def entry_label(entry: dict) -> str:
    """An inbox entry as the picker lists it: a taught answer, or a preference's pair."""
    label = f"{entry['id']}: {_short(readable_prompt(entry['prompt']))} → {_short(entry['answer'])}"
    return label + (f" over {_short(entry['rejected'])}" if entry.get("rejected") is not None else "")


def _short(text: Any, width: int = 40) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 1] + "…"


def do_set_weight(backend: Backend, panel: DataPanel, path: str | None, source: str | None, weight: str) -> dict:
    if not source:
        raise SessionError("pick a source first")
    value = number(weight, "the weight")
    backend.verbs(path).set_weight(source, value)
    done = f"**{source}** weighs {value:g} from the next step" + (" (paused)" if value == 0 else "")
    return {panel.result: done + ".", **show(backend, panel, path)}


def do_remove(backend: Backend, panel: DataPanel, path: str | None, source: str | None) -> dict:
    if not source:
        raise SessionError("pick a source first")
    backend.verbs(path).remove_source(source)
    return {panel.result: f"**{source}** is no longer drawn from.", **show(backend, panel, path)}


def do_add(backend: Backend, panel: DataPanel, path: str | None, file: str, fmt: str, weight: str,
           name: str) -> dict:
    file = (file or "").strip()
    if not file:
        raise SessionError("add a source: type the path of a file or folder")
    value = number(weight, "the weight")
    result = backend.verbs(path).add_source(file, weight=value, format=fmt or "auto", name=(name or "").strip())
    added, report = result.source, result.report
    text = f"**Added {added.get('name', (name or '').strip() or file)}** (weight {value:g})."
    return {panel.result: text + (f" {report}" if report else ""), **show(backend, panel, path)}


def do_forget(backend: Backend, panel: DataPanel, path: str | None, entry: str | None) -> dict:
    if not entry:
        raise SessionError("pick an inbox entry first")
    backend.verbs(path).forget(entry)
    return {panel.result: f"**{entry}** is no longer trained on (the inbox keeps its record).",
            **show(backend, panel, path)}
