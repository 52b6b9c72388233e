"""The run's inbox: answers taught from the chat, an append-only JSON lines file in the run folder.

    {"op": "add", "id": "t3", "prompt": "<s>capital: zorb\\n", "answer": "qux", "step": 40, "time": ...}
    {"op": "forget", "id": "t3", "step": 52, "time": ...}
    {"op": "add", "id": "t4", "prompt": "...", "answer": "better", "rejected": "worse", ...}  (a preference)
    {"op": "add", "id": "t5", "kind": "rating", "step": 7, "score": 1.0, "rated": 2, "prompt_ids": [...],
     "completion_ids": [[...], ...], "rewards": {"exact": [1.0, null, ...]}, ...}  (a GRPO sample's rating)

`prompt` is the text the model continued (its chat template applied), `answer` the corrected
answer. An entry is never rewritten: forgetting appends a line. Every write is flushed and
fsynced before the run answers the Teach, so a crash right after it loses nothing. Torch-free:
front ends read the inbox of a run that is not running.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

INBOX_FILE = "inbox.jsonl"


class InboxError(ValueError):
    """A teach that cannot be taken; the message names the field."""


@dataclass
class InboxEntry:
    """One taught pair; `removed` once forgotten (it is then no longer trained on)."""
    id: str
    prompt: str
    answer: str
    step: int
    time: float
    removed: bool = False
    rejected: str | None = None  # a preference: `answer` is better than this one

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.rejected is None:  # a taught answer's line stays as it always was
            del out["rejected"]
        return out


def inbox_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / INBOX_FILE


def _append(path: Path, record: dict) -> None:
    """One line, flushed and fsynced (the file is created on the first write)."""
    line = json.dumps(record, ensure_ascii=False) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def _records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash mid-write: nothing was answered
            continue
        if isinstance(record, dict) and record.get("op") in ("add", "forget"):
            out.append(record)
    return out


def next_id(path: Path) -> str:
    """A new entry id: t<n>, n = the entries ever added + 1 (unique in the file)."""
    return f"t{sum(r['op'] == 'add' for r in _records(path)) + 1}"


def check_pair(prompt: str, answer: str) -> None:
    """Refuse an empty prompt or answer (the length limit is the engine's: it has the tokenizer)."""
    if not isinstance(answer, str) or not answer.strip():
        raise InboxError("teach: `answer` is empty; write the answer the model should have given")
    if not isinstance(prompt, str) or not prompt:
        raise InboxError("teach: `prompt` is empty")


def add_entry(path: Path, entry_id: str, prompt: str, answer: str, step: int,
              rejected: str | None = None) -> InboxEntry:
    """Append a taught pair (a preference with `rejected`) durably; returns the entry."""
    check_pair(prompt, answer)
    entry = InboxEntry(entry_id, prompt, answer, int(step), time.time(), rejected=rejected)
    _append(path, {"op": "add", **entry.to_dict()})
    return entry


def forget_entry(path: Path, entry_id: str, step: int) -> None:
    """Append the removal of `entry_id` durably."""
    _append(path, {"op": "forget", "id": entry_id, "step": int(step), "time": time.time()})


RATING = "rating"  # the `kind` of a rating's line (engine.objectives.grpo_samples writes and replays it)


def add_rating(path: Path, entry_id: str, step: int, rating: dict) -> dict:
    """Append a rating of a GRPO sample durably (what replays it: the prompt and the group's
    completion ids, their rewards, the rated one and its score); returns its record."""
    record = {"op": "add", "id": entry_id, "kind": RATING, **rating, "step": int(step), "time": time.time()}
    _append(path, record)
    return record


def read_ratings(path: str | Path) -> list[dict]:
    """Every rating in the order given, each with `forgotten_at`: the step of its forget, or None."""
    ratings: dict[str, dict] = {}
    for r in _records(Path(path)):
        if r["op"] == "add" and r.get("kind") == RATING:
            ratings[r["id"]] = {**r, "forgotten_at": None}
        elif r["op"] == "forget" and r.get("id") in ratings:
            ratings[r["id"]]["forgotten_at"] = int(r.get("step", 0))
    return list(ratings.values())


def read_inbox(path: str | Path) -> list[InboxEntry]:
    """Every entry in the order taught, forgotten ones marked `removed`."""
    entries: dict[str, InboxEntry] = {}
    for r in _records(Path(path)):
        if r["op"] == "add" and isinstance(r.get("prompt"), str) and isinstance(r.get("answer"), str):
            rejected = r.get("rejected") if isinstance(r.get("rejected"), str) else None
            entries[r["id"]] = InboxEntry(r["id"], r["prompt"], r["answer"], int(r.get("step", 0)),
                                          float(r.get("time", 0.0)), rejected=rejected)
        elif r["op"] == "forget" and r.get("id") in entries:
            entries[r["id"]].removed = True
    return list(entries.values())


def check_weight(value: object, field: str) -> float:
    """A weight: a finite number >= 0 (0 pauses), or an error naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InboxError(f"{field} must be a number >= 0 (0 pauses the source), got {value!r}")
    return float(value)
