"""Data rows without a tokenizer: reading files into numbered rows, detecting their format,
checking one row. Torch-free, so that the pre-flight check (contract.preflight) and the engine's
data layer (engine.data, which tokenizes what passes here) run the same code.

=============  ==========================================  ===================================
format         row                                         loss on
=============  ==========================================  ===================================
text           {"text"}                                    every token
input_output   {"input", "output"}                         the output tokens (+ eos)
chat           {"messages": [{"role", "content"}, ...]}    assistant turns (chat template)
tokenized      {"input_ids", "labels"?}                    labels (default: input_ids)
preference     {"prompt", "chosen", "rejected"}            chosen and rejected answers (pairs)
unpaired       {"prompt", "completion", "label"}           the completion, desirable or not (KTO)
prompt         {"prompt", ...}                             sampled answers, by their rewards (GRPO)
=============  ==========================================  ===================================

The two preference formats feed the preference objectives (engine.objectives.preference, docs/preferences.md).
Their text form holds strings; their chat form holds a list of messages as `prompt` and lists of
assistant messages as `chosen` / `rejected` / `completion` (TRL's conversational form).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

IGNORE = -100
FORMATS = ("text", "input_output", "chat", "tokenized", "preference", "unpaired", "prompt")
PREFERENCE_FORMATS = ("preference", "unpaired")  # rows of pairs / judged answers, not of text
# Detection order: a row with {"messages"} is chat even if it also has a "text" field, etc.
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",), "tokenized": ("input_ids",), "input_output": ("input", "output"),
    "text": ("text",), "preference": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"), "prompt": ("prompt",)}  # prompt last: the others have one too
JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")
SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet")
MAX_EXAMPLES = 20  # rows named verbatim per message or report; the counts cover every row


class DataError(ValueError):
    """Data that cannot be used: an unreadable file, mixed formats, no usable row left, ..."""


class RowIssue(Exception):
    """Why one row cannot be used: a short reason category and a sentence naming the field."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class UnreadableRow:
    """A row that could not even be parsed (kept so that it is reported, not skipped)."""

    detail: str


NumberedRows = list[tuple[int, Any]]  # (1-based row number, dict or UnreadableRow or anything)


# -- formats ------------------------------------------------------------------------------------

def detect_format(row: Any) -> str | None:
    """The format whose keys `row` has (None values count as absent: Arrow fills missing keys
    with None), or None when it has none of them."""
    if not isinstance(row, dict):
        return None
    for fmt, keys in FORMAT_KEYS.items():
        if all(row.get(k) is not None for k in keys):
            return fmt
    return None


def describe_keys() -> str:
    """Every format and its keys, for messages."""
    return "; ".join(f"{fmt}: {', '.join(keys)}" for fmt, keys in FORMAT_KEYS.items())


def detect_rows_format(name: str, rows: NumberedRows) -> str:
    """The format of the first row that has one; every other row that has a format must agree.
    Raises DataError naming the rows otherwise."""
    found = [(number, fmt) for number, row in rows if (fmt := detect_format(row)) is not None]
    if not found:
        first = next((row for _, row in rows if isinstance(row, dict)), None)
        keys = sorted(first) if first is not None else "no object rows"
        raise DataError(f"data: cannot detect the format of {name}: no row has the keys of any "
                        f"format ({describe_keys()}); the first row has {keys}")
    first_row, fmt = found[0]
    others = [(number, other) for number, other in found if other != fmt]
    if others:
        shown = ", ".join(f"row {n} is {f}" for n, f in others[:MAX_EXAMPLES])
        raise DataError(f"data: {name} mixes row formats: row {first_row} is {fmt} but {shown}"
                        f"{' ...' if len(others) > MAX_EXAMPLES else ''}; use one format per file "
                        "or set data.format explicitly")
    return fmt


# -- checking one row (pure Python, no tokenizer) -----------------------------------------------

def _field(row: Any, key: str) -> Any:
    if not isinstance(row, dict):
        raise RowIssue("wrong type", f"a row must be an object with keys, not {type(row).__name__}")
    if row.get(key) is None:
        raise RowIssue("missing key", f"missing key {key!r}")
    return row[key]


def _string(value: Any, name: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RowIssue("wrong type", f"{name!r} must be a string, not {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise RowIssue("empty", f"{name!r} is empty")
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RowIssue("wrong type", f"{name!r} must be a list of integers")
    if not value:
        raise RowIssue("empty", f"{name!r} is empty")
    return list(value)


def check_text(row: Any) -> str:
    return _string(_field(row, "text"), "text")


def check_input_output(row: Any) -> tuple[str, str]:
    # the input may be empty (pure generation); the output may not (nothing to learn)
    prompt = _string(_field(row, "input"), "input", allow_empty=True)
    return prompt, _string(_field(row, "output"), "output")


def check_chat(row: Any) -> list[dict]:
    messages = _field(row, "messages")
    if not isinstance(messages, (list, tuple)):
        raise RowIssue("wrong type", f"'messages' must be a list of {{role, content}} objects, "
                       f"not {type(messages).__name__}")
    if not messages:
        raise RowIssue("empty", "'messages' is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowIssue("wrong type", f"'messages[{i}]' must be an object, not {type(message).__name__}")
        _string(_field(message, "role"), f"messages[{i}].role")
        _string(_field(message, "content"), f"messages[{i}].content", allow_empty=True)
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise RowIssue("no assistant turn", "'messages' has no assistant turn with content "
                       "(the loss is computed on assistant turns only)")
    return list(messages)


def check_tokenized(row: Any) -> tuple[list[int], list[int]]:
    ids = _int_list(_field(row, "input_ids"), "input_ids")
    if row.get("labels") is None:
        return ids, list(ids)
    labels = _int_list(row["labels"], "labels")
    if len(labels) != len(ids):
        raise RowIssue("wrong type", f"'labels' has {len(labels)} entries but 'input_ids' {len(ids)}")
    return ids, labels


@dataclass(frozen=True)
class PreferenceRow:
    """A checked preference row: text (strings) or chat (`prompt` a list of messages, each
    answer a list of assistant messages). `answers` holds (chosen, rejected) for a pair, the one
    completion for an unpaired row; `label` is None for a pair, else whether it is desirable."""
    prompt: str | list[dict]
    answers: tuple
    label: bool | None = None

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


def _messages(value: Any, name: str, assistant_only: bool) -> list[dict]:
    if not isinstance(value, (list, tuple)) or not value:
        raise RowIssue("wrong type" if not isinstance(value, (list, tuple)) else "empty",
                       f"{name!r} must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RowIssue("wrong type", f"'{name}[{i}]' must be an object, not {type(message).__name__}")
        role = _string(_field(message, "role"), f"{name}[{i}].role")
        _string(_field(message, "content"), f"{name}[{i}].content", allow_empty=not assistant_only)
        if assistant_only and role != "assistant":
            raise RowIssue("wrong role", f"'{name}[{i}].role' must be 'assistant' (an answer), not {role!r}")
    return list(value)


def _prompt_and_answers(row: Any, keys: tuple[str, ...]) -> tuple[Any, tuple]:
    """The prompt and the answers of `keys`, all text or all chat (never a mix)."""
    prompt = _field(row, "prompt")
    values = [_field(row, key) for key in keys]
    if isinstance(prompt, str):
        for key, value in zip(keys, values):
            if not isinstance(value, str):
                raise RowIssue("mixed forms", f"'prompt' is text but {key!r} is {type(value).__name__}; "
                               "give every field as text, or prompt as messages and answers as "
                               "lists of assistant messages")
        return prompt, tuple(_string(v, k) for k, v in zip(keys, values))
    return (_messages(prompt, "prompt", assistant_only=False),
            tuple(_messages(v, k, assistant_only=True) for k, v in zip(keys, values)))


def check_preference(row: Any) -> PreferenceRow:
    prompt, (chosen, rejected) = _prompt_and_answers(row, ("chosen", "rejected"))
    if chosen == rejected:
        raise RowIssue("same answers", "'chosen' and 'rejected' are the same answer (nothing to prefer)")
    return PreferenceRow(prompt, (chosen, rejected))


def check_unpaired(row: Any) -> PreferenceRow:
    prompt, answers = _prompt_and_answers(row, ("completion",))
    label = _field(row, "label")
    if not isinstance(label, bool):
        raise RowIssue("wrong type", f"'label' must be true (a desirable completion) or false, "
                       f"not {label!r}")
    return PreferenceRow(prompt, answers, label)


@dataclass(frozen=True)
class PromptRow(PreferenceRow):
    """A checked GRPO row: its prompt (text or messages) and its other columns, which the reward
    functions receive (contract.rewards); no answer yet (`answers` holds an empty one, so that
    size estimates read it as a pair with nothing to learn from yet)."""
    columns: dict = field(default_factory=dict)


def check_prompt(row: Any) -> PromptRow:
    prompt = _field(row, "prompt")
    prompt = _string(prompt, "prompt") if isinstance(prompt, str) else _messages(prompt, "prompt", False)
    columns = {k: v for k, v in row.items() if k != "prompt"}
    return PromptRow(prompt, ("",) if isinstance(prompt, str) else ([],), None, columns)


def _shown(value: str | list[dict]) -> str:
    if isinstance(value, str):
        return value
    return "\n".join(f"{m['role']}: {m['content']}" for m in value)


def preference_columns(row: Any) -> dict[str, str] | None:
    """A preference row as text columns for a preview that shows the answers side by side:
    {"prompt", "chosen", "rejected"} or {"prompt", "completion", "label"} (messages as
    "role: content" lines); None for a row that does not pass its check."""
    fmt = detect_format(row)
    if fmt not in PREFERENCE_FORMATS:
        return None
    try:
        checked = CHECKS[fmt](row)
    except RowIssue:
        return None
    columns = {"prompt": _shown(checked.prompt)}
    if checked.label is None:
        columns.update(chosen=_shown(checked.answers[0]), rejected=_shown(checked.answers[1]))
    else:
        columns.update(completion=_shown(checked.answers[0]),
                       label="desirable" if checked.label else "undesirable")
    return columns


CHECKS: dict[str, Callable[[Any], Any]] = {
    "text": check_text, "input_output": check_input_output, "chat": check_chat,
    "tokenized": check_tokenized, "preference": check_preference, "unpaired": check_unpaired,
    "prompt": check_prompt}


# -- reading files ------------------------------------------------------------------------------

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
