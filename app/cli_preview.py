"""`./launch.sh preview DATA [format=F] [max_length=N] [overlong=O] [model=FOLDER] [objective=O]
[start=N]`: what a run would read from a data file, in the terminal: rows and format (the engine's
own code reads the file: `app.data_preview.data_preview`), then a page of its rows with each
row's length in tokens and what a run does with it at data.max_length / data.overlong (kept,
truncated, dropped and why, refused), the page the web app and the notebook show
(`app.data_preview.rows_page`); `start=20` shows the next page. Text from the file is printed as
text, never as rich markup."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from app.data_preview import PAGE_ROWS, RowsPage, data_preview, page_header, page_or_error, summary
from contract.config.schema import OBJECTIVES, RunConfig

USAGE = ("usage: ./launch.sh preview DATA_FILE [format=auto|text|input_output|chat|tokenized|preference|unpaired|prompt]"
         " [max_length=N] [overlong=truncate|drop|error] [model=FOLDER] [objective=" + "|".join(OBJECTIVES) + "]"
         " [start=N]\n  max_length and overlong default to the run config's (data.max_length "
         f"{RunConfig().data.max_length}, data.overlong {RunConfig().data.overlong}); model: whose tokenizer counts the "
         f"tokens (default: the embedded default's); start: rows skipped ({PAGE_ROWS} to a page: start={PAGE_ROWS} shows the next)")
OPTIONS = ("format", "max_length", "overlong", "model", "objective", "start")


def rows_table(page: RowsPage) -> Table:
    """The page as a table: row, the file's columns, tokens, what the run does with the row."""
    keys = list(dict.fromkeys(k for line in page.rows for k in line.columns))
    table = Table(title=Text(page_header(page)), title_justify="left", expand=True)
    table.add_column("row", justify="right", no_wrap=True)
    for key in keys:
        table.add_column(key, ratio=2, overflow="fold")
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("the run", ratio=2, overflow="fold")
    for line in page.rows:
        tokens = "–" if line.tokens is None else f"{'' if line.exact else '~'}{line.tokens}"
        table.add_row(str(line.number), *(Text(line.columns.get(k, "")) for k in keys), tokens, Text(line.fate))
    return table


def _options(argv: list[str]) -> dict[str, str] | None:
    """The key=value options after the file, or None when one is unknown or not key=value."""
    options = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in OPTIONS or key in options:
            return None
        options[key] = value
    return options


def preview(argv: list[str], console: Console | None = None) -> int:
    """Print the preview of `argv[0]`; 0 when the file can be used, 1 when not, 2 on bad usage."""
    console = console or Console()
    options = _options(argv[1:]) if argv and argv[0] not in ("-h", "--help") else None
    try:
        defaults = RunConfig().data
        limits = {"max_length": int(options.pop("max_length", defaults.max_length)),
                  "overlong": options.pop("overlong", defaults.overlong), "start": int(options.pop("start", 0)),
                  "objective": options.pop("objective", None)} if options is not None else None
    except ValueError:
        limits = None
    if limits is None or limits["start"] < 0 or limits["overlong"] not in ("truncate", "drop", "error") \
            or limits["objective"] not in (None, *OBJECTIVES):
        console.print(Text(USAGE), soft_wrap=True)
        return 2
    fmt = options.get("format", "auto")
    info = data_preview(argv[0], fmt)
    console.print(Text(summary(info), style=None if info.get("ok") else "red"))
    if not info.get("ok"):
        return 1
    page = page_or_error(argv[0], fmt=fmt, tokenizer_folder=options.get("model") or None, **limits)
    if isinstance(page, str):
        console.print(Text(page, style="red"))
        return 1
    console.print(rows_table(page))
    if page.start + len(page.rows) < page.total:
        console.print(Text(f"next page: start={page.start + len(page.rows)}"))
    return 1 if page.refused else 0
