"""Reading a data source into numbered rows (contract.data_rows checks each one): a file, a
`datasets.Dataset` or a list of rows in memory. Torch-free.

JSON and JSON lines are parsed here with :mod:`json`, line by line, so a broken line is reported
with its line number and every value keeps its exact type (Arrow would unify a column's types or
refuse the whole file). CSV, Parquet and `save_to_disk` folders go through `datasets` (torch-free,
imported only for them); its cache goes to a temporary folder removed once the rows are in memory.
Row numbers are 1-based: the line of a JSON lines file, the position in a JSON list, a CSV file's
data rows (the header is not a row), a Parquet / saved dataset row.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from contract.data_rows import DataError, NumberedRows, UnreadableRow

JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")
SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet")


def load_rows(source: str | Path | Iterable[dict]) -> list[dict]:
    """The rows of `source` as dicts (unparseable lines left out: `build_dataset` reports them)."""
    _, rows = read_rows(source)
    return [row for _, row in rows if isinstance(row, dict)]


def read_rows(source: str | Path | Iterable[dict]) -> tuple[str, NumberedRows]:
    """(a name for messages, the numbered rows) of a path, a `datasets.Dataset` or a list of rows."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        return str(path), _read_path(path)
    if hasattr(source, "to_list"):  # a datasets.Dataset (or anything shaped like one)
        rows = source.to_list()
    else:
        try:
            rows = list(source)
        except TypeError:
            raise DataError(f"data source must be a path or a list of dict rows, not "
                            f"{type(source).__name__}") from None
    return f"<{len(rows)} rows given in memory>", list(enumerate(rows, start=1))


def _read_path(path: Path) -> NumberedRows:
    if not path.exists():
        raise DataError(f"data: no such file or folder: {path}")
    if path.is_dir():
        return _read_saved_dataset(path)
    suffix = path.suffix.lower()
    if suffix in JSON_LINES_SUFFIXES:
        return _read_json_lines(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".csv":
        return _with_datasets(path, "CSV", lambda ds, p, cache: ds.Dataset.from_csv(
            str(p), cache_dir=cache, keep_in_memory=True))
    if suffix == ".parquet":
        return _with_datasets(path, "Parquet", lambda ds, p, cache: ds.Dataset.from_parquet(
            str(p), cache_dir=cache, keep_in_memory=True))
    raise DataError(f"data: cannot tell the format of {path} from its suffix {suffix!r}; "
                    f"allowed: {', '.join(SUFFIXES)} or a folder written by datasets' save_to_disk")


def _text_of(path: Path) -> str:
    """The file as UTF-8 text; a file that is not names the line and byte of the first bad byte."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"data: cannot read {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"data: {path} is not UTF-8 text: line {line} (byte {e.start}) holds "
                        f"{data[e.start:e.end]!r}, which UTF-8 cannot decode; save the file as "
                        "UTF-8") from None


def _read_json_lines(path: Path) -> NumberedRows:
    text = _text_of(path)
    if text.lstrip().startswith("["):  # a JSON array where one object per line is expected
        with contextlib.suppress(json.JSONDecodeError):
            if isinstance(json.loads(text), list):
                raise DataError(f"data: {path} holds one JSON array, but a {path.suffix} file holds "
                                "one JSON object per line; rename it to .json, or write one object "
                                "per line")
    return list(_json_lines(path, text))


def _json_lines(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    """Rows numbered by their line; blank lines are not rows."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            yield number, UnreadableRow(f"line {number} of {path.name} is not valid JSON ({e.msg})")


def _read_json(path: Path) -> NumberedRows:
    text = _text_of(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several values one after another: it is JSON lines
            return list(_json_lines(path, text))
        raise DataError(f"data: {path} is not valid JSON: {e}") from None
    if not isinstance(value, list):
        raise DataError(f"data: {path} must hold a JSON list of objects (or one object per "
                        f"line), not a JSON {type(value).__name__}")
    return list(enumerate(value, start=1))


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    from datasets import utils as ds_tqdm
    was_disabled = ds_tqdm.are_progress_bars_disabled()
    ds_tqdm.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            ds_tqdm.enable_progress_bars()


def _with_datasets(path: Path, kind: str, read: Callable[[Any, Path, str], Any]) -> NumberedRows:
    import datasets
    with tempfile.TemporaryDirectory(prefix="livetune-data-") as cache, _quiet_datasets():
        try:
            rows = read(datasets, path, cache).to_list()
        except Exception as e:  # Arrow / pandas raise many types; all mean "unreadable"
            raise DataError(f"data: cannot read {path} as {kind}: {type(e).__name__}: {e}") from None
    return list(enumerate(rows, start=1))


def _read_saved_dataset(path: Path) -> NumberedRows:
    import datasets
    with _quiet_datasets():
        try:
            loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
        except Exception as e:
            raise DataError(f"data: {path} is a folder but not one written by datasets' "
                            f"save_to_disk: {type(e).__name__}: {e}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if len(loaded) != 1:
            raise DataError(f"data: {path} holds the splits {sorted(loaded)}; name one of them, "
                            f"e.g. {path / sorted(loaded)[0]}")
        loaded = next(iter(loaded.values()))
    return list(enumerate(loaded.to_list(), start=1))
