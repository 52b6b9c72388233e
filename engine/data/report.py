"""What building a dataset found: rows read, kept, dropped (why, which rows), truncated, tokens."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# DataError and MAX_EXAMPLES (problems kept verbatim per report) are the contract's, shared with
# the pre-flight check.
from contract.data_rows import MAX_EXAMPLES


@dataclass(frozen=True)
class RowProblem:
    """One row that was dropped (or truncated): its 1-based row number, the field and why."""

    row: int
    reason: str   # short category: "missing key", "wrong type", "empty", "overlong", ...
    detail: str   # the full sentence, naming the field

    def __str__(self) -> str:
        return f"row {self.row}: {self.detail}"


@dataclass
class DataReport:
    """The outcome of :func:`engine.data.build_dataset`; every dropped or truncated row is counted.

    Row numbers are 1-based: the line number in a JSON lines file, the position in a JSON list,
    a CSV file's data rows (the header is not a row), a Parquet / saved dataset or a Python list.
    """

    source: str
    format: str = ""
    max_length: int = 0
    rows_read: int = 0
    rows_kept: int = 0
    total_tokens: int = 0          # tokens of the kept samples (after truncation)
    trained_tokens: int = 0        # of which carry a label (loss is computed on them)
    truncated: int = 0
    drop_reasons: Counter = field(default_factory=Counter)
    problems: list[RowProblem] = field(default_factory=list)       # first MAX_EXAMPLES drops
    truncated_rows: list[int] = field(default_factory=list)        # first MAX_EXAMPLES

    @property
    def dropped(self) -> int:
        return sum(self.drop_reasons.values())

    def drop(self, row: int, reason: str, detail: str) -> None:
        self.drop_reasons[reason] += 1
        if len(self.problems) < MAX_EXAMPLES:
            self.problems.append(RowProblem(row, reason, detail))

    def truncate(self, row: int) -> None:
        self.truncated += 1
        if len(self.truncated_rows) < MAX_EXAMPLES:
            self.truncated_rows.append(row)

    def summary(self) -> str:
        """A few lines for a log or the UI: counts, reasons, the first problem rows."""
        lines = [f"{self.source}: format {self.format or '?'}, {self.rows_read} rows read, "
                 f"{self.rows_kept} kept, {self.dropped} dropped, {self.truncated} truncated to "
                 f"{self.max_length} tokens; {self.total_tokens} tokens "
                 f"({self.trained_tokens} with a label)"]
        if self.drop_reasons:
            lines.append("dropped: " + ", ".join(f"{n} {r}" for r, n in sorted(self.drop_reasons.items())))
            lines += [f"  {p}" for p in self.problems]
            if self.dropped > len(self.problems):
                lines.append(f"  ... and {self.dropped - len(self.problems)} more")
        if self.truncated:
            more = "" if self.truncated <= len(self.truncated_rows) else ", ..."
            lines.append("truncated rows: " + ", ".join(map(str, self.truncated_rows)) + more)
        return "\n".join(lines)
