"""The run panel's samples fold (a GRPO run), as the web Train tab's: the latest step's samples
as a table (prompt, each completion, each reward function's score, the total, the advantage;
rows from app.samples, shared with the web page), sorted by any column, a sample rated up, down
or with a score through the one set of verbs (`rate`), a rating forgotten (`forget`), the run's
answer or refusal shown under them. The table follows the run: the panel's watcher hands each new
history to `show` (its thread, never the kernel's); commands go through the panel's command
thread (`RunPanel._command`)."""

from __future__ import annotations

import html
from concurrent.futures import Future
from typing import Any, Callable

import ipywidgets as widgets

from app.notebook.api import Run
from app.samples import NO_SAMPLES, SamplesTable, forgot_text, rated_text, ratings, samples_table, sorted_rows
from app.series import RunHistory
from app.session import allowed

Send = Callable[[str, Callable[[Run], Any]], "Future | None"]
SCORES = ["up", "down"]  # the box's suggestions; any number in [-1, 1] may be typed instead
_UNSEEN = object()       # no samples event drawn yet, not even "none"


class SamplesControls:
    """The latest samples table, its sort, Rate and Forget."""

    def __init__(self, get_run: Callable[[], Run | None], send: Send, on_error: Callable[[str], None],
                 get_history: Callable[[], RunHistory | None]):
        self._get_run, self._send, self._error, self._get_history = get_run, send, on_error, get_history
        self.shown = samples_table(None)
        self._record: object = _UNSEEN  # the samples event shown (None: none)
        self.caption = widgets.HTML(html.escape(NO_SAMPLES))
        self.table = widgets.HTML()
        self.sort = widgets.Dropdown(options=self.shown.columns, value="#", description="sort by",
                                     layout=widgets.Layout(width="240px"))
        self.descending = widgets.Checkbox(value=False, description="descending", indent=False,
                                           layout=widgets.Layout(width="110px"))
        self.sort.observe(lambda _: self._draw(), names="value")
        self.descending.observe(lambda _: self._draw(), names="value")
        self.sample = widgets.BoundedIntText(value=0, min=0, max=1 << 30, description="sample #",
                                             layout=widgets.Layout(width="180px"))
        self.score = widgets.Combobox(value="up", options=SCORES, description="rating",
                                      placeholder="up, down or a score in [-1, 1]", layout=widgets.Layout(width="260px"))
        self.rate_button = _button("Rate", "thumbs-up", self.rate)
        self.rating = widgets.Dropdown(description="rating", layout=widgets.Layout(width="520px"))
        self.forget_button = _button("Forget the rating", "times", self.forget, "160px")
        self.refresh_button = _button("Refresh", "refresh", self.refresh, "100px")
        self.result = widgets.HTML()
        self.widget = widgets.VBox([
            self.caption, widgets.HBox([self.sort, self.descending]), self.table,
            widgets.HBox([self.sample, self.score, self.rate_button]),
            widgets.HBox([self.rating, self.forget_button, self.refresh_button]), self.result])
        self._draw()

    def show(self, history: RunHistory | None) -> None:
        """Draw the history's latest samples when they are new (the watcher calls this each tick)."""
        record = history.samples if history is not None else None
        if record is self._record:
            return
        self._record, self.shown = record, samples_table(record)
        table = self.shown
        self.caption.value = html.escape(table.caption)
        if list(self.sort.options) != table.columns:
            self.sort.options = table.columns  # the reward functions may change mid-run
        self._draw()
        self._list_ratings()

    def refresh(self, state: str | None = None) -> None:
        """Show the run's latest samples and its ratings again."""
        run = self._get_run()
        self._record = _UNSEEN
        self.show(self._get_history() if run is not None else None)
        self._list_ratings()
        self.enable(state if state is not None else (run.info().state if run is not None else None))

    def enable(self, state: str | None) -> None:
        ok = allowed(state)
        self.rate_button.disabled = "rate" not in ok
        self.forget_button.disabled = "forget" not in ok

    def rate(self) -> Future | None:
        """Rate the chosen sample of the shown step; the answer (or refusal) shown under it."""
        step, sample, score = self.shown.step, self.sample.value, self.score.value.strip() or "up"
        if step is None:
            self._refused("rate: no samples yet (a GRPO run shows them after each step)")
            return None
        return self._after(self._send("rate", lambda run: run.rate(step, sample, score)), rated_text, "rate")

    def forget(self) -> Future | None:
        entry = self.rating.value
        if not entry:
            self._refused("forget: pick a rating first")
            return None
        return self._after(self._send("forget rating", lambda run: run.forget(entry)), forgot_text, "forget")

    # -- drawing ------------------------------------------------------------------------------
    def _draw(self) -> None:
        rows = sorted_rows(self.shown, self.sort.value or "#", self.descending.value)
        self.table.value = _table(self.shown.columns, rows)

    def _list_ratings(self) -> None:
        run = self._get_run()
        given = [(g.label, g.id) for g in ratings(run.path) if not g.forgotten] if run is not None else []
        if list(self.rating.options) != given:
            self.rating.options = given
            self.rating.value = given[-1][1] if given else None

    def _after(self, future: Future | None, words: Callable[[Any], str], label: str) -> Future | None:
        def done(f: Future) -> None:
            error = f.exception()
            if error is not None:
                self.result.value = f"<span style='color:#b00020'>{html.escape(f'{label} refused: {error}')}</span>"
                return
            self.result.value = html.escape(words(f.result()))
            self._list_ratings()
        if future is not None:
            future.add_done_callback(done)
        return future

    def _refused(self, text: str) -> None:
        self.result.value = f"<span style='color:#b00020'>{html.escape(text)}</span>"
        self._error(text)


def _button(label: str, icon: str, action: Callable[[], Any], width: str = "110px") -> widgets.Button:
    b = widgets.Button(description=label, icon=icon, layout=widgets.Layout(width=width))
    b.on_click(lambda _: action())
    return b


def _table(head: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return "<i>none yet</i>"
    cells = "".join("<tr>" + "".join(f"<td style='padding:0 8px;white-space:pre-wrap;vertical-align:top'>"
                                     f"{'' if c is None else html.escape(str(c))}</td>" for c in row) + "</tr>"
                    for row in rows)
    heads = "".join(f"<th style='padding:0 8px;text-align:left'>{html.escape(h)}</th>" for h in head)
    return (f"<div style='max-height:380px;overflow:auto'><table style='font-size:90%'><tr>{heads}</tr>"
            f"{cells}</table></div>")

