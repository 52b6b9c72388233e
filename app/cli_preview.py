"""`./launch.sh preview DATA [format=FORMAT]`: what a run would read from a data file, in the
terminal: rows, format, and the first rows; preference rows side by side (the prompt above,
chosen | rejected; a KTO row's completion beside its label). The engine's own code reads the file
(`app.data_preview`); text from the file is printed as text, never as rich markup."""

from __future__ import annotations

import json

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from app.data_preview import data_preview, pair_views, summary

USAGE = "usage: ./launch.sh preview DATA_FILE [format=auto|text|input_output|chat|tokenized|preference|unpaired]"


def pairs_table(pairs: list[dict]) -> Group:
    """The pairs, each a two-column table (chosen | rejected, or completion | label) under its prompt."""
    tables = []
    for n, view in enumerate(pair_views(pairs), 1):
        title = Text.assemble((f"row {n} · prompt: ", "italic"), view.prompt.rstrip("\n"))
        table = Table(title=title, title_justify="left", expand=True)
        table.add_column(view.left[0], ratio=1)
        table.add_column(view.right[0], ratio=1)
        table.add_row(Text(view.left[1]), Text(view.right[1]))
        tables.append(table)
    return Group(*tables)


def preview(argv: list[str], console: Console | None = None) -> int:
    """Print the preview of `argv[0]`; 0 when the file can be used, 1 when not, 2 on bad usage."""
    console = console or Console()
    formats = [a.removeprefix("format=") for a in argv[1:] if a.startswith("format=")]
    if len(argv) < 1 or argv[0] in ("-h", "--help") or len(argv) - 1 != len(formats) or len(formats) > 1:
        console.print(Text(USAGE), soft_wrap=True)
        return 2
    info = data_preview(argv[0], formats[0] if formats else "auto")
    console.print(Text(summary(info), style=None if info.get("ok") else "red"))
    if not info.get("ok"):
        return 1
    if info.get("pairs"):
        console.print(pairs_table(info["pairs"]))
    else:
        for row in info.get("examples") or []:
            console.print(Text(json.dumps(row, ensure_ascii=False)))
    return 0
