"""`build_dataset`: rows -> checked, tokenized, length-limited samples plus a report of it all."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from torch.utils.data import Dataset

from contract.data_rows import PREFERENCE_FORMATS, detect_rows_format
from engine.data import preference
from contract.data_rows import CHECKS, FORMATS, IGNORE, RowIssue
from engine.data.formats import ENCODERS
from contract.data_files import read_rows
from contract.data_rows import NumberedRows, UnreadableRow
from contract.data_rows import DataError, MAX_EXAMPLES
from engine.data.report import DataReport

OVERLONG = ("truncate", "drop", "error")
CHUNK = 1024  # rows tokenized per batched tokenizer call


class TokenizedDataset(Dataset):
    """Samples {"input_ids": list[int], "labels": list[int]}; `lengths` for length-aware batching;
    `rows` the 1-based source row of each sample."""

    def __init__(self, samples: list[dict], rows: list[int] | None = None):
        self.samples = samples
        self.lengths = [len(s["input_ids"]) for s in samples]
        self.rows = rows if rows is not None else list(range(1, len(samples) + 1))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def build_dataset(source: str | Path | Iterable[dict], tokenizer, format: str = "auto",
                  max_length: int = 512, overlong: str = "truncate") -> tuple[TokenizedDataset, DataReport]:
    """Read `source` (a path or a list of dict rows), check and tokenize every row.

    Bad rows are dropped and reported with their row number; samples longer than `max_length`
    are truncated, dropped or refused (`overlong`), and counted either way. Raises
    :class:`DataError` when the source cannot be read, mixes formats under "auto", has an
    overlong row under overlong="error", or leaves no usable row.
    """
    _check_arguments(format, max_length, overlong)
    name, rows = read_rows(source)
    if not rows:
        raise DataError(f"data: {name} has no rows")
    report = DataReport(name, max_length=max_length, rows_read=len(rows))
    report.format = format if format != "auto" else detect_rows_format(name, rows)
    if report.format == "prompt":  # prompts without answers: sampled and scored (engine.data.prompts)
        raise DataError(f"data: {name} holds prompt rows ({{prompt, ...}}), which train "
                        "preference.objective grpo (learning from rewards), not this objective")
    paired = report.format in PREFERENCE_FORMATS  # samples of pairs / judged answers (engine.data.preference)
    samples, kept_rows, overlong_rows = [], [], []
    for start in range(0, len(rows), CHUNK):
        for number, result in _encode_chunk(rows[start:start + CHUNK], report.format, tokenizer):
            if isinstance(result, RowIssue):
                report.drop(number, result.reason, result.detail)
                continue
            if paired:
                sample = preference.limit(number, result, max_length, overlong, report, overlong_rows)
            else:
                sample = _limit(number, *result, max_length, overlong, report, overlong_rows)
            if sample is not None:
                samples.append(sample)
                kept_rows.append(number)
    if overlong_rows:
        shown = ", ".join(map(str, overlong_rows[:MAX_EXAMPLES]))
        raise DataError(f"data: {len(overlong_rows)} rows of {name} are longer than max_length="
                        f"{max_length} tokens (rows {shown}{', ...' if len(overlong_rows) > MAX_EXAMPLES else ''})"
                        "; raise data.max_length or set data.overlong to 'truncate' or 'drop'")
    report.rows_kept = len(samples)
    if not samples:
        raise DataError(f"data: no usable row in {name} (format {report.format}).\n{report.summary()}")
    if paired:
        return preference.PreferenceDataset(samples, kept_rows), report  # type: ignore[return-value]
    return TokenizedDataset(samples, kept_rows), report


def _check_arguments(format: str, max_length: int, overlong: str) -> None:
    if format not in ("auto", *FORMATS):
        raise DataError(f"data.format must be one of {('auto', *FORMATS)}, not {format!r}")
    if overlong not in OVERLONG:
        raise DataError(f"data.overlong must be one of {OVERLONG}, not {overlong!r}")
    if not isinstance(max_length, int) or max_length < 2:
        raise DataError(f"data.max_length must be an integer >= 2, not {max_length!r}")


def _encode_chunk(chunk: NumberedRows, fmt: str, tokenizer) -> list[tuple[int, Any]]:
    """(row number, (ids, labels) or RowIssue) for each row of `chunk`, in order."""
    results: list[tuple[int, Any]] = []
    payloads, slots = [], []
    for number, row in chunk:
        if isinstance(row, UnreadableRow):
            results.append((number, RowIssue("invalid JSON", row.detail)))
            continue
        try:
            payloads.append(CHECKS[fmt](row))
            slots.append(len(results))
            results.append((number, None))
        except RowIssue as issue:
            results.append((number, issue))
    for slot, encoded in zip(slots, ENCODERS[fmt](tokenizer, payloads) if payloads else []):
        results[slot] = (results[slot][0], encoded)
    return results


def _limit(number: int, ids: list[int], labels: list[int], max_length: int, overlong: str,
           report: DataReport, overlong_rows: list[int]) -> dict | None:
    """Apply the length policy and the has-something-to-learn check; count what happens."""
    truncated = len(ids) > max_length
    if truncated and overlong == "drop":
        report.drop(number, "overlong", f"{len(ids)} tokens, more than max_length={max_length}")
        return None
    if truncated and overlong == "error":
        overlong_rows.append(number)
        return None
    if truncated:
        ids, labels = ids[:max_length], labels[:max_length]
    # the label at position 0 is never predicted (nothing comes before it)
    if all(label == IGNORE for label in labels[1:]):
        why = (f"no labelled token is left after truncation to max_length={max_length}" if truncated
               else "no token to learn from (a sample needs a labelled token after its first)")
        report.drop(number, "nothing to learn", why)
        return None
    if truncated:
        report.truncate(number)
    report.total_tokens += len(ids)
    report.trained_tokens += sum(label != IGNORE for label in labels[1:])
    return {"input_ids": ids, "labels": labels}
