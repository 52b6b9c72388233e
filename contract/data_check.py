"""The data part of the pre-flight check: every data file read, its format detected, its rows
counted and checked, the rows that will be dropped named by row number, and the rows that will
be truncated estimated, all without a tokenizer model in memory.

Reading and checking use the engine's own code (contract.data_rows), so what is refused here is
what the engine would refuse after start. Lengths are not tokenized row by row (that can take
minutes on a large file): every row's characters are counted and divided by a characters-per-token
ratio, measured with the model's own `tokenizer.json` (the `tokenizers` library, no torch) on a
sample of SAMPLE_ROWS rows, or taken as DEFAULT_CHARS_PER_TOKEN without one; messages say which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.config.schema import OBJECTIVE_FORMATS
from contract.data_files import read_rows
from contract.data_rows import (CHECKS, FORMAT_KEYS, MAX_EXAMPLES, DataError, PreferenceRow, RowIssue,
                                UnreadableRow, detect_rows_format)

SAMPLE_ROWS = 256              # rows tokenized to measure the characters per token
DEFAULT_CHARS_PER_TOKEN = 4.0  # English text with a BPE tokenizer, roughly; used without tokenizer.json
SPECIAL_TOKENS = 2             # bos and eos around a sample
LOUD_TRUNCATION_SHARE = 0.10   # more truncated rows than this share: said loudly before start


@dataclass
class DataScan:
    """What reading and checking one data file found (independent of max_length)."""
    path: str
    format: str
    rows: int
    dropped: list[tuple[int, str]] = field(default_factory=list)  # (row, why), every one
    chars: dict[int, int] = field(default_factory=dict)           # row -> characters (or tokens)
    exact_tokens: bool = False                                    # chars holds token counts (tokenized rows)
    prompt_chars: dict[int, int] = field(default_factory=dict)    # row -> its prompt's characters (preference rows)


_CACHE: dict[tuple, DataScan] = {}  # (path, size, mtime, format) -> scan: forms re-check often


def scan_file(path: str, fmt: str) -> DataScan:
    """Read and check every row of `path` (DataError naming the file for what makes it unusable)."""
    p = Path(path)
    stat = p.stat() if p.is_file() else None
    key = (str(p), stat.st_size if stat else None, stat.st_mtime_ns if stat else None, fmt)
    if stat is not None and key in _CACHE:
        return _CACHE[key]
    name, rows = read_rows(p)
    if not rows:
        raise DataError(f"data: {name} has no rows (the file is empty)")
    detected = fmt if fmt != "auto" else detect_rows_format(name, rows)
    scan = DataScan(name, detected, len(rows), exact_tokens=detected == "tokenized")
    for number, row in rows:
        if isinstance(row, UnreadableRow):
            scan.dropped.append((number, row.detail))
            continue
        try:
            payload = CHECKS[detected](row)
        except RowIssue as issue:
            scan.dropped.append((number, issue.detail))
            continue
        scan.chars[number] = _size(detected, payload)
        if isinstance(payload, PreferenceRow):
            scan.prompt_chars[number] = _chars(payload.prompt)
    if stat is not None:
        _CACHE[key] = scan
    return scan


def _size(fmt: str, payload: Any) -> int:
    """Characters of a checked row's text (tokens for pre-tokenized rows)."""
    if fmt == "text":
        return len(payload)
    if fmt == "input_output":
        return len(payload[0]) + len(payload[1])
    if fmt == "chat":
        return _chars(payload)
    if isinstance(payload, PreferenceRow):  # a pair is as long as its prompt and longer answer
        return _chars(payload.prompt) + max(_chars(a) for a in payload.answers)
    return len(payload[0])


def _chars(value: str | list[dict]) -> int:
    """Characters of a text, or of messages (the role's characters stand in for the template's
    markers around each message)."""
    if isinstance(value, str):
        return len(value)
    return sum(len(m["content"]) + len(m["role"]) for m in value)


def _text(payload: Any) -> str:
    if isinstance(payload, str):
        return payload
    if isinstance(payload, PreferenceRow):
        return "\n".join(_text(part) for part in (payload.prompt, *payload.answers))
    if isinstance(payload, tuple):
        return payload[0] + payload[1]
    return "\n".join(m["content"] for m in payload)


def chars_per_token(tokenizer_folder: str | None, scan: DataScan) -> tuple[float, str]:
    """(ratio, how it was found): measured with the folder's tokenizer.json on a sample of the
    scanned rows, 1.0 for the embedded default's character-level tokenizer (folder None)."""
    if tokenizer_folder is None:
        return 1.0, "the embedded default's tokenizer has one token per character"
    tok_file = Path(tokenizer_folder) / "tokenizer.json"
    if not tok_file.is_file():
        return DEFAULT_CHARS_PER_TOKEN, (f"estimated at {DEFAULT_CHARS_PER_TOKEN:g} characters per "
                                         "token (the model folder has no tokenizer.json to measure with)")
    texts = _sample_texts(scan)
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_file))
        tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    except Exception as e:  # noqa: BLE001 - a tokenizer.json tokenizers cannot read: estimate instead
        return DEFAULT_CHARS_PER_TOKEN, (f"estimated at {DEFAULT_CHARS_PER_TOKEN:g} characters per token "
                                         f"({tok_file} could not be read: {type(e).__name__})")
    chars = sum(len(t) for t in texts)
    ratio = chars / tokens if tokens else DEFAULT_CHARS_PER_TOKEN
    return ratio, (f"estimated from each row's characters at {ratio:.2f} characters per token, as the "
                   f"model's tokenizer measured on {len(texts)} rows")


_SAMPLE_TEXT: dict[str, list[str]] = {}


def _sample_texts(scan: DataScan) -> list[str]:
    """Up to SAMPLE_ROWS texts of the file's usable rows, spread over the file."""
    if scan.path in _SAMPLE_TEXT:
        return _SAMPLE_TEXT[scan.path]
    _, rows = read_rows(scan.path)
    usable = [row for number, row in rows if number in scan.chars]
    step = max(1, len(usable) // SAMPLE_ROWS)
    texts = []
    for row in usable[::step][:SAMPLE_ROWS]:
        texts.append(_text(CHECKS[scan.format](row)))
    _SAMPLE_TEXT[scan.path] = texts
    return texts


def overlong_rows(scan: DataScan, max_length: int, ratio: float) -> list[int]:
    """Row numbers whose estimated length (exact for tokenized rows) exceeds max_length."""
    out = []
    for number, size in scan.chars.items():
        if scan.exact_tokens:
            tokens = size
        else:
            tokens = math.ceil(size / ratio) + SPECIAL_TOKENS
        if tokens > max_length:
            out.append(number)
    return out


def prompt_filling_rows(scan: DataScan, max_length: int, ratio: float) -> list[int]:
    """Preference rows whose prompt alone (estimated) fills max_length: no answer token would be
    left after truncation, so the engine drops them (as TRL does)."""
    return [number for number, size in scan.prompt_chars.items()
            if math.ceil(size / ratio) + SPECIAL_TOKENS - 1 >= max_length]


def named_rows(rows: list[int]) -> str:
    """'rows 3, 7, 9' (the first MAX_EXAMPLES, then how many more)."""
    shown = ", ".join(map(str, rows[:MAX_EXAMPLES]))
    more = f" and {len(rows) - MAX_EXAMPLES} more" if len(rows) > MAX_EXAMPLES else ""
    return f"row{'s' * (len(rows) != 1)} {shown}{more}"


def _keys(fmt: str) -> str:
    """`{prompt, chosen, rejected}`: the keys that make a row of `fmt`."""
    return "{" + ", ".join(FORMAT_KEYS.get(fmt, (fmt,))) + "}"


def objective_problem(objective: str, fmt: str, source: str) -> str | None:
    """Why training rows of format `fmt` (found in `source`) cannot train `objective`, or None:
    a preference objective trains on its own rows only (OBJECTIVE_FORMATS), and rows that train
    a preference objective are not SFT samples. A micro-batch holds samples of one kind."""
    wanted = OBJECTIVE_FORMATS.get(objective)
    if wanted is None and fmt in OBJECTIVE_FORMATS.values():
        takers = " or ".join(o for o, f in OBJECTIVE_FORMATS.items() if f == fmt)
        return (f"{source} holds {fmt} rows {_keys(fmt)}, which train a preference objective, but "
                f"preference.objective is {objective}: set preference.objective={takers} for these rows, "
                "or give SFT rows ({text}, {input, output}, {messages} or {input_ids, labels})")
    if wanted is not None and fmt != wanted:
        return (f"{source} holds {fmt} rows {_keys(fmt)}, but preference.objective {objective} trains "
                f"on {wanted} rows {_keys(wanted)}: give such a file, or set preference.objective=sft "
                "for these rows")
    return None
