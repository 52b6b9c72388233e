"""A data file's preview for every front end, preference rows shown side by side.

The engine's own code reads the file (`python -m engine.preview`, op `data`, in a child process:
the app never imports torch). For preference data its answer holds `pairs`, the first rows as text
columns: {"prompt", "chosen", "rejected"}, or KTO's {"prompt", "completion", "label"}. This module
lays them out as a two-column view, the prompt above and chosen | rejected under it (a KTO row:
its completion beside its label), as Markdown (the web app, when no page can be shown) and HTML
(the notebook).

    info = data_preview("pairs.jsonl")      # {"ok": True, "rows", "format", "pairs", ...}
    pairs_markdown(info["pairs"])

A page of rows as the run would take them (`rows_page`): each row's number, its columns, its length
in tokens and what the run does with it at a given data.max_length and data.overlong (kept,
truncated, dropped and why, or refused), and why a run would refuse the whole file (rows of
another kind than preference.objective trains on, a row too long under data.overlong error): at
start and by a live add_source alike, which read a file the same way; a row that is too long is
also marked as refused if taught live (teach refuses it whatever data.overlong). The web app,
the notebook and the terminal (`./launch.sh preview FILE start=20`) all show this page. It reads
the file with the pre-flight check's own code
(contract.data_check: the same row checks as the engine, lengths estimated from characters at the
ratio the model's tokenizer.json measures, exact for the embedded default's one token per
character and for pre-tokenized rows), in this process: no torch.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.data_check import (SPECIAL_TOKENS, DataScan, chars_per_token, named_rows, objective_problem,
                                 overlong_rows, prompt_filling_rows, scan_file)
from contract.data_files import read_rows
from contract.data_rows import PREFERENCE_FORMATS, DataError, preference_columns
from supervisor.launch import REPO_ROOT

TIMEOUT_S = 120.0  # reading a file is quick; the engine's data modules import in about a second
_MARKUP = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~])")


@dataclass(frozen=True)
class PairView:
    """One preview row as two columns under its prompt: (heading, text) left and right."""
    prompt: str
    left: tuple[str, str]
    right: tuple[str, str]


def data_preview(path: str | Path, fmt: str = "auto", timeout: float = TIMEOUT_S) -> dict:
    """The engine's preview of a data file: {"ok": True, "rows", "format", "keys", "examples",
    "pairs" (preference data), ...} or {"ok": False, "error"}; never raises for a bad file."""
    request = json.dumps({"op": "data", "path": str(Path(path).expanduser().resolve()), "format": fmt})
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    try:
        done = subprocess.run([sys.executable, "-m", "engine.preview"], input=request + "\n", text=True,
                              capture_output=True, timeout=timeout, cwd=str(REPO_ROOT), env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the preview process gave no answer within {timeout:g} s"}
    lines = done.stdout.strip().splitlines()
    if not lines:
        return {"ok": False, "error": f"the preview process ended (exit {done.returncode}) without an answer: "
                                      f"{done.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def pair_views(pairs: list[dict] | None) -> list[PairView]:
    """The preview's pairs as two columns each: chosen | rejected, or a KTO row's completion |
    its label (desirable or undesirable)."""
    views = []
    for pair in pairs or []:
        if "chosen" in pair:
            left, right = ("chosen", str(pair["chosen"])), ("rejected", str(pair.get("rejected", "")))
        else:
            left, right = ("completion", str(pair.get("completion", ""))), ("label", str(pair.get("label", "")))
        views.append(PairView(str(pair.get("prompt", "")), left, right))
    return views


def pairs_markdown(pairs: list[dict] | None) -> str:
    """The pairs as Markdown: per row, its prompt, then a two-column table (text as typed:
    Markdown's markup escaped, line breaks shown as ⏎)."""
    parts = []
    for n, view in enumerate(pair_views(pairs), 1):
        parts.append(f"row {n} · prompt: {_plain(view.prompt)}\n\n"
                     f"| {view.left[0]} | {view.right[0]} |\n|---|---|\n"
                     f"| {_plain(view.left[1])} | {_plain(view.right[1])} |")
    return "\n\n".join(parts)


def pairs_html(pairs: list[dict] | None) -> str:
    """The pairs as one HTML table: per row, its prompt across both columns, then the two answers."""
    views = pair_views(pairs)
    if not views:
        return ""
    cell = "style='padding:2px 8px;vertical-align:top;white-space:pre-wrap;text-align:left'"
    head = (f"<tr><th {cell}>{html.escape(views[0].left[0])}</th>"
            f"<th {cell}>{html.escape(views[0].right[0])}</th></tr>")
    body = "".join(f"<tr><td colspan='2' {cell}><i>prompt:</i> {html.escape(v.prompt)}</td></tr>"
                   f"<tr><td {cell}>{html.escape(v.left[1])}</td><td {cell}>{html.escape(v.right[1])}</td></tr>"
                   for v in views)
    return f"<table class='lt-pairs' style='font-size:90%;border-collapse:collapse'>{head}{body}</table>"


def summary(info: dict) -> str:
    """One line on the file: rows, format, unreadable rows, other formats (or the error)."""
    if not info.get("ok"):
        return f"cannot use this data: {info.get('error')}"
    text = f"{info['rows']} rows, format {info['format']} (keys: {', '.join(info.get('keys') or []) or 'none'})"
    if info.get("unreadable"):
        text += f"; {info['unreadable']} unreadable rows (first: {info['unreadable_rows']})"
    if info.get("other_formats"):
        text += f"; other formats also present: {', '.join(info['other_formats'])}"
    return text


def _plain(text: Any) -> str:
    """`text` as it is, in Markdown: markup escaped, on one line."""
    return _MARKUP.sub(r"\\\1", " ⏎ ".join(str(text).splitlines()) or " ")


PAGE_ROWS = 20  # rows per page of the preview
CELL_CHARS = 60  # a column's text shown per cell


@dataclass(frozen=True)
class RowLine:
    """One row of the page: its number in the file, its columns (shortened), its length in tokens
    (`exact` False: estimated) and what the run does with it."""
    number: int
    columns: dict[str, str]
    tokens: int | None
    exact: bool
    fate: str


@dataclass(frozen=True)
class RowsPage:
    """A page of a file's rows, how their lengths were found, and why a run would refuse the
    whole file (None: it would not)."""
    rows: list[RowLine]
    total: int
    start: int
    lengths: str  # how the token counts were found (measured ratio, estimate, exact)
    refused: str | None = None


# Rows a person can also teach in the chat (an answer, a pair): taught live, a sample longer than
# data.max_length is refused whatever data.overlong says (engine.data.inbox.encode_pair).
TEACHABLE = ("input_output", "chat", "preference", "unpaired")


def rows_page(path: str | Path, fmt: str = "auto", max_length: int = 0, overlong: str = "truncate",
              tokenizer_folder: str | None = None, start: int = 0, size: int = PAGE_ROWS,
              objective: str | None = None) -> RowsPage:
    """Rows `start`..`start + size` of the file as the run would take them at `max_length`
    (0: no limit) and `overlong` (data.overlong); `tokenizer_folder` the model's folder (None:
    the embedded default); `objective` (preference.objective; None: not judged) refuses rows of
    another kind. What the page says a run does with a row holds at start and for a live
    add_source alike (the same reading); `refused` says why either would refuse the whole file.
    DataError (naming the file) for a file the run could not use at all."""
    scan = scan_file(str(path), fmt)
    ratio, how = chars_per_token(tokenizer_folder, scan)
    fates = _fates(scan, max_length, overlong, ratio)
    _, numbered = read_rows(Path(path))
    refused = _refusal(scan, fates, objective, max_length, overlong)
    lines = []
    for number, row in numbered[start:start + size]:
        size_ = scan.chars.get(number)
        tokens = None if size_ is None else size_ if scan.exact_tokens else math.ceil(size_ / ratio) + SPECIAL_TOKENS
        columns = {k: _cell(v) for k, v in _columns(row, scan.format).items()}
        lines.append(RowLine(number, columns, tokens, scan.exact_tokens or tokenizer_folder is None,
                             fates.get(number, "refused with the file" if refused else "kept")))
    return RowsPage(lines, scan.rows, start, "exact" if scan.exact_tokens else how, refused)


def _fates(scan: DataScan, max_length: int, overlong: str, ratio: float) -> dict[int, str]:
    """What the run does with each row that it does not simply keep."""
    fates = {number: f"dropped: {why}" for number, why in scan.dropped}
    if max_length > 0:
        live = " (taught live: refused)" if scan.format in TEACHABLE else ""
        too_long = {"truncate": f"truncated to {max_length} tokens{live}",
                    "drop": f"dropped: longer than data.max_length {max_length}{live}",
                    "error": f"refused: longer than data.max_length {max_length} (data.overlong error: "
                             "the whole file is refused)"}
        for number in overlong_rows(scan, max_length, ratio):
            fates[number] = too_long[overlong]
        for number in prompt_filling_rows(scan, max_length, ratio):
            fates[number] = f"dropped: its prompt alone fills data.max_length {max_length}"
    return fates


def _refusal(scan: DataScan, fates: dict[int, str], objective: str | None, max_length: int,
             overlong: str) -> str | None:
    """Why the run refuses the whole file, at start and live (add_source: the run goes on
    without it), in the engine's words where it has them; None when it takes the file."""
    problem = objective_problem(objective, scan.format, Path(scan.path).name) if objective else None
    if problem:
        return problem
    refused = sorted(n for n, fate in fates.items() if fate.startswith("refused:"))
    if refused:
        return (f"{named_rows(refused)} longer than data.max_length {max_length} under data.overlong "
                "error; set it to truncate or drop, or raise data.max_length")
    if sum(fate.startswith("dropped") for fate in fates.values()) >= scan.rows:
        return "no row is left to train on"
    return None


def _columns(row: Any, fmt: str) -> dict[str, Any]:
    """A row's columns as the page shows them: a preference row's as text (messages as
    "role: content" lines, a KTO label as desirable / undesirable), others as they are."""
    shown = preference_columns(row) if fmt in PREFERENCE_FORMATS else None
    return shown or (row if isinstance(row, dict) else {"row": row})


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ⏎ ".join(text.splitlines())
    return text if len(text) <= CELL_CHARS else text[:CELL_CHARS - 1] + "…"


def _length(line: RowLine) -> str:
    return "–" if line.tokens is None else f"{'' if line.exact else '~'}{line.tokens}"


def page_header(page: RowsPage) -> str:
    """'rows 1-20 of 300; token lengths: ...', and why a run would refuse the file, if it would."""
    refused = (f"; refused as a whole, at start and by a live add_source (the run goes on without it): "
               f"{page.refused}") if page.refused else ""
    if not page.rows:
        return f"no rows from {page.start + 1} (the file has {page.total}){refused}"
    estimated = " (~: estimated)" if any(not line.exact for line in page.rows) else ""
    return (f"rows {page.rows[0].number}-{page.rows[-1].number} of {page.total}; token lengths: "
            f"{page.lengths}{estimated}{refused}")


def rows_markdown(page: RowsPage) -> str:
    """The page as a Markdown table: row, its columns, tokens, what the run does with it."""
    keys = list(dict.fromkeys(k for line in page.rows for k in line.columns))
    head = ["row", *keys, "tokens", "the run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for line in page.rows:
        cells = [str(line.number), *(_plain(line.columns.get(k, "")) for k in keys), _length(line), _plain(line.fate)]
        lines.append("| " + " | ".join(cells) + " |")
    return page_header(page) + "\n\n" + "\n".join(lines)


def rows_html(page: RowsPage) -> str:
    """The page as an HTML table (the notebook)."""
    keys = list(dict.fromkeys(k for line in page.rows for k in line.columns))
    cell = "style='padding:2px 8px;vertical-align:top;text-align:left'"
    head = "".join(f"<th {cell}>{html.escape(h)}</th>" for h in ["row", *keys, "tokens", "the run"])
    body = "".join("<tr>" + "".join(f"<td {cell}>{html.escape(c)}</td>" for c in
                                    [str(line.number), *(line.columns.get(k, "") for k in keys), _length(line),
                                     line.fate]) + "</tr>" for line in page.rows)
    return (f"<div><i>{html.escape(page_header(page))}</i><table class='lt-rows' style='font-size:90%;"
            f"border-collapse:collapse'><tr>{head}</tr>{body}</table></div>")


def page_or_error(path: str | Path, **options: Any) -> RowsPage | str:
    """rows_page, or the reason the file cannot be used (never raises for a bad file)."""
    try:
        return rows_page(path, **options)
    except (DataError, OSError, ValueError) as e:
        return f"cannot show its rows: {e}"
