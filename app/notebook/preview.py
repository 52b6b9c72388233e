"""A data file's preview in a notebook: `preview_data("pairs.jsonl")` shows its rows and format,
and preference rows side by side (the prompt above, chosen | rejected; a KTO row's completion
beside its label), read by the engine's own code in a child process (`app.data_preview`)."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from app.data_preview import data_preview, pairs_html, summary


@dataclass(frozen=True)
class DataPreview:
    """The engine's answer (`info`) and its rendering: HTML in a notebook, text elsewhere."""
    info: dict

    @property
    def pairs(self) -> list[dict]:
        return list(self.info.get("pairs") or [])

    def _repr_html_(self) -> str:
        return f"<div><b>{html.escape(summary(self.info))}</b>{pairs_html(self.pairs)}</div>"

    def __repr__(self) -> str:
        lines = [summary(self.info)]
        for pair in self.pairs:
            lines.append("  " + " | ".join(f"{k}: {v!r}" for k, v in pair.items()))
        return "\n".join(lines)


def preview_data(path: str | Path, format: str = "auto") -> DataPreview:
    """What the run would read from `path` (`format` as data.format takes it): rows, format and
    the first rows; shown as a table in the notebook."""
    return DataPreview(data_preview(path, format))
