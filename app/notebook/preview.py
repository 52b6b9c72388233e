"""A data file's preview in a notebook: `preview_data("pairs.jsonl")` shows its rows and format,
preference rows side by side (the prompt above, chosen | rejected; a KTO row's completion beside
its label), read by the engine's own code in a child process (`app.data_preview`), and a page of
its rows with their token lengths and what the run does with each at the given data.max_length
and data.overlong (kept, truncated, dropped, refused: `app.data_preview.rows_page`).

    preview_data("pairs.jsonl", max_length=256, model="models/my-llama")
    preview_data("pairs.jsonl", start=20)      # the next page
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from app.data_preview import PAGE_ROWS, RowsPage, data_preview, page_header, page_or_error, pairs_html, rows_html, summary


@dataclass(frozen=True)
class DataPreview:
    """The engine's answer (`info`), a page of rows (`page`, or why there is none) and their
    rendering: HTML in a notebook, text elsewhere."""
    info: dict
    page: RowsPage | str | None = None

    @property
    def pairs(self) -> list[dict]:
        return list(self.info.get("pairs") or [])

    def _repr_html_(self) -> str:
        rows = rows_html(self.page) if isinstance(self.page, RowsPage) else (
            f"<p>{html.escape(self.page)}</p>" if self.page else "")
        return f"<div><b>{html.escape(summary(self.info))}</b>{pairs_html(self.pairs)}{rows}</div>"

    def __repr__(self) -> str:
        lines = [summary(self.info)]
        for pair in self.pairs:
            lines.append("  " + " | ".join(f"{k}: {v!r}" for k, v in pair.items()))
        if isinstance(self.page, RowsPage):
            lines.append(page_header(self.page))
            lines += [f"  row {r.number}: {r.tokens if r.tokens is not None else '-'} tokens, {r.fate}"
                      for r in self.page.rows]
        return "\n".join(lines)


def preview_data(path: str | Path, format: str = "auto", max_length: int = 0, overlong: str = "truncate",
                 model: str | None = None, start: int = 0, size: int = PAGE_ROWS,
                 objective: str | None = None) -> DataPreview:
    """What the run would read from `path` (`format` as data.format takes it): rows, format, the
    first rows side by side, and rows `start`..`start + size` with their token lengths (measured
    with `model`'s tokenizer.json; None: the embedded default) and what a run at `max_length`
    (data.max_length; 0: no limit) and `overlong` (data.overlong) does with each; with `objective`
    (preference.objective), whether a run of it refuses the file's rows."""
    page = page_or_error(path, fmt=format, max_length=max_length, overlong=overlong, tokenizer_folder=model,
                         start=start, size=size, objective=objective)
    return DataPreview(data_preview(path, format), page)
