"""A data file's preview for every front end, preference rows shown side by side.

The engine's own code reads the file (`python -m engine.preview`, op `data`, in a child process:
the app never imports torch). For preference data its answer holds `pairs`, the first rows as text
columns: {"prompt", "chosen", "rejected"}, or KTO's {"prompt", "completion", "label"}. This module
lays them out as a two-column view, the prompt above and chosen | rejected under it (a KTO row:
its completion beside its label), as Markdown (the web app), HTML (the notebook) and rows for a
terminal table (app.cli's `preview`).

    info = data_preview("pairs.jsonl")      # {"ok": True, "rows", "format", "pairs", ...}
    pairs_markdown(info["pairs"])
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
