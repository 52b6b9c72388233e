"""The order the suite's files run in: the costliest first, so the two test workers end together.

pytest-xdist (`--dist loadfile`) hands whole files to its workers in the order they were
collected (launch.sh turns off its reordering by test count, which put the few long multi-rank
files last: one worker then ran them alone for minutes). Files run longest-first make a short
tail. The costs are seconds per file from a `--durations=0` run; they only order the files (a
new file without a cost runs after the known ones), so stale figures cost time, never a result.

Record them again after a full run:  python tests/file_costs.py LOG  (LOG: pytest's output with
--durations=0); it rewrites tests/file_costs.json.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

COSTS = Path(__file__).with_name("file_costs.json")
_LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(tests/[^:]+\.py)::")


def file_costs() -> dict[str, float]:
    """Seconds per test file (its path from the project root), as last recorded."""
    return json.loads(COSTS.read_text()) if COSTS.exists() else {}


def costliest_first(items: list) -> None:
    """Reorder pytest items in place: whole files, the costliest first; a file's own order kept."""
    costs = file_costs()
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))
    items.sort(key=lambda item: (-costs.get(item.nodeid.split("::")[0], 0.0),
                                 first_seen[item.nodeid.split("::")[0]]))


def record(log: Path) -> dict[str, float]:
    """Sum a --durations=0 log per file and write tests/file_costs.json."""
    costs: dict[str, float] = defaultdict(float)
    for line in log.read_text(errors="replace").splitlines():
        if match := _LINE.match(line):
            costs[match[2]] += float(match[1])
    ordered = {path: round(seconds, 1) for path, seconds in sorted(costs.items(), key=lambda kv: -kv[1])}
    COSTS.write_text(json.dumps(ordered, indent=1) + "\n")
    return ordered


if __name__ == "__main__":
    for path, seconds in record(Path(sys.argv[1])).items():
        print(f"{seconds:8.1f}  {path}")
