"""The Train tab's samples fold (a GRPO run): the latest step's samples as a sortable table
(prompt, each completion, each reward function's score, the total, the advantage; app.samples
builds the rows for this page and the notebook alike), a sample picked by clicking its row and
rated up, down or with a score through the one set of verbs (`rate`), the run's answer or refusal
shown under it, and a rating forgotten (`forget`). Read when the fold opens, on Refresh and after
each rating (not every step: a table of 64 answers is no plot point)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from app.samples import NO_SAMPLES, SamplesTable, forgot_text, rated_text, ratings, samples_table
from app.session import SessionError, allowed
from app.web.access import OPERATOR
from app.web.backend import Backend
from app.web.widgets import TABLE_CLASS
from contract.protocol.roles import Role

SCORES = ["up", "down"]  # the picker's words; any number in [-1, 1] may be typed instead


@dataclass
class SamplesPanel:
    caption: gr.Markdown
    table: gr.Dataframe
    step: gr.Number
    sample: gr.Number
    score: gr.Dropdown
    rate: gr.Button
    rating: gr.Dropdown
    forget: gr.Button
    refresh: gr.Button
    result: gr.Markdown

    def outputs(self) -> list:
        return [self.caption, self.table, self.step, self.rating, self.rate, self.forget]


def build(backend: Backend, run_state: gr.State) -> SamplesPanel:
    """The fold's layout and events (placed by the Train tab under its plots)."""
    with gr.Accordion("Samples (GRPO): the latest step's answers and their rewards; rate one", open=False,
                      elem_id="samples-fold") as fold:
        caption = gr.Markdown(NO_SAMPLES, elem_id="samples-caption")
        table = gr.Dataframe(_frame(samples_table(None)), interactive=False, elem_id="samples-table", wrap=True,
                             max_height=380, elem_classes=[TABLE_CLASS],
                             label="Click a row to pick its sample; click a header to sort.")
        with gr.Row(equal_height=True):
            step = gr.Number(None, label="Step", precision=0, interactive=False, scale=1, elem_id="samples-step")
            sample = gr.Number(None, label="Sample #", precision=0, minimum=0, scale=1, elem_id="samples-sample")
            score = gr.Dropdown(SCORES, value="up", allow_custom_value=True, scale=1, elem_id="samples-score",
                                label="Rating: up, down, or a score in [-1, 1]")
            rate = gr.Button("Rate", interactive=False, scale=1, elem_id="samples-rate", elem_classes=[OPERATOR])
        with gr.Row(equal_height=True):
            rating = gr.Dropdown([], label="A rating given", scale=3, elem_id="samples-rating")
            forget = gr.Button("Forget the rating", interactive=False, scale=1, elem_id="samples-forget",
                               elem_classes=[OPERATOR])
            refresh = gr.Button("Refresh", scale=1, elem_id="samples-refresh")
        result = gr.Markdown("", elem_id="samples-result")
    panel = SamplesPanel(caption, table, step, sample, score, rate, rating, forget, refresh, result)
    look: dict[str, Any] = dict(fn=lambda p: show(backend, panel, p), inputs=run_state, outputs=panel.outputs(),
                                api_visibility="private", show_progress="hidden")
    refresh.click(**look)
    fold.expand(**look)
    table.select(pick, inputs=None, outputs=sample, api_visibility="private", show_progress="hidden")
    act: dict[str, Any] = dict(outputs=[result, *panel.outputs()], api_visibility="private", concurrency_limit=None)
    rate.click(lambda p, t, n, s: do_rate(backend, panel, p, t, n, s), inputs=[run_state, step, sample, score], **act)
    forget.click(lambda p, r: do_forget(backend, panel, p, r), inputs=[run_state, rating], **act)
    return panel


def pick(event: gr.SelectData) -> Any:
    """The clicked row's sample number (its `#`, the first column: right after a sort too)."""
    row = event.row_value
    return row[0] if row else gr.update()


def show(backend: Backend, panel: SamplesPanel, path: str | None) -> dict:
    """One look: the latest samples (the run's history, read from its log), the ratings given,
    the buttons its state allows."""
    try:
        path = backend.session.resolve(path)
    except SessionError:
        return _shown(panel, samples_table(None), [], None)
    view = backend.watch.view(path)
    view.poll()
    given = [(g.label, g.id) for g in ratings(path) if not g.forgotten]
    return _shown(panel, samples_table(view.history.samples), given, backend.session.info(path).state,
                  backend.session.role_of())


def _shown(panel: SamplesPanel, table: SamplesTable, given: list[tuple[str, str]], state: str | None,
           role: Role = Role.OPERATOR) -> dict:
    ok = allowed(state, role)  # a viewer's login: all off
    return {panel.caption: table.caption, panel.table: _frame(table), panel.step: table.step,
            panel.rating: gr.update(choices=given, value=given[-1][1] if given else None),
            panel.rate: gr.update(interactive="rate" in ok and table.step is not None),
            panel.forget: gr.update(interactive="forget" in ok and bool(given))}


def _frame(table: SamplesTable) -> pd.DataFrame:
    # object columns keep None as None (shown empty), not NaN
    return pd.DataFrame(table.rows, columns=table.columns, dtype=object)


def do_rate(backend: Backend, panel: SamplesPanel, path: str | None, step: float | None, sample: float | None,
            score: str | float | None) -> dict:
    """Rate sample `sample` of step `step` through the verbs; the answer or the refusal shown."""
    if step is None or sample is None:
        return {panel.result: "**Not rated**: pick a sample first (click its row in the table)."}
    try:
        answer = backend.verbs(path).rate(int(step), int(sample), "up" if score in (None, "") else score)
    except SessionError as e:
        return {panel.result: f"**Not rated**: {e}"}
    return {panel.result: rated_text(answer), **show(backend, panel, path)}


def do_forget(backend: Backend, panel: SamplesPanel, path: str | None, rating: str | None) -> dict:
    """Forget the picked rating through the verbs; the answer or the refusal shown."""
    if not rating:
        return {panel.result: "**Not forgotten**: pick a rating first."}
    try:
        answer = backend.verbs(path).forget(rating)
    except SessionError as e:
        return {panel.result: f"**Not forgotten**: {e}"}
    return {panel.result: forgot_text(answer), **show(backend, panel, path)}
