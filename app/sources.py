"""A run's training data as the front ends show it: its sources with their weights,
the samples drawn from each (per step, and in total), and the inbox of answers taught from the
chat with the engine's check of each (the answer before and after). Read from the run folder
alone (config.yaml, events.jsonl, inbox.jsonl), so it works for a run that has ended too.
Torch-free, Gradio-free, ipywidgets-free.

    view = data_view(RunFolder(path))
    view.sources     # [{"name", "path", "format", "weight", "seen"}, ...] as of the last change
    view.seen        # {source: [(step, samples drawn so far), ...]}
    view.inbox       # [{"id", "prompt", "answer", "step", "removed", "old", "new", "learned"}, ...]
                     # a preference also "rejected", "margin_before", "margin_after", "prefers";
                     # its "learned": the model prefers the chosen answer at the check (margin > 0)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import re

import yaml

from contract.inbox import InboxEntry, inbox_path, read_inbox
from contract.run_folder import RunFolder, read_models
from contract.events import (BranchEvent, CheckpointEvent, DataEvent, Event, RewindEvent, SnapshotEvent, TeachCheckEvent,
                             TeachEvent, TrainEvent, as_event)

Point = tuple[int, float]
DEFAULT_SOURCE = "train"  # the one-source shorthand's name (data.train, or the embedded task)
# the special tokens a prompt holds as the model saw it: <s> </s> <pad> <unk> <bos> <eos>, and
# <|...|> markers (<|user|>, <|assistant|>, <|begin_of_text|>, <|im_start|> ...)
SPECIAL_TOKEN = re.compile(r"</?s>|<(?:pad|unk|bos|eos)>|<\|[^|<>\s]{1,40}\|>")


@dataclass
class DataView:
    sources: list[dict]
    seen: dict[str, list[Point]]
    inbox: list[dict]


def data_view(folder: RunFolder, events: Iterable[Event | dict[str, Any]] | None = None,
              live_sources: list[dict] | None = None) -> DataView:
    """The sources, samples drawn and inbox of the run in `folder` (`events`: its log, already
    read: models or JSON objects). `live_sources`: the sources as the running run says now (its
    `status`), which win over the event log's account."""
    raw = read_models(folder.events) if events is None else events
    sources = configured_sources(folder)
    totals: dict[str, float] = {}
    seen: dict[str, list[Point]] = {}
    checks: dict[str, TeachCheckEvent] = {}  # each entry's latest check
    margins: dict[str, Any] = {}  # a preference's margin when it came in (its teach event's extra `margin`)
    # the sources as each checkpoint / snapshot recorded them: a rewind to one takes them back
    kept: dict[str, list[dict]] = {}
    for event in map(as_event, raw):
        if isinstance(event, DataEvent) and event.sources is not None:
            sources = [dict(s) for s in event.sources]
        elif isinstance(event, CheckpointEvent):
            kept[_key(event.path)] = [dict(s) for s in sources]
        elif isinstance(event, SnapshotEvent):
            kept[_key(f"snapshot:{event.name}")] = [dict(s) for s in sources]
        elif isinstance(event, (RewindEvent, BranchEvent)) and _key(event.source) in kept:
            sources = [dict(s) for s in kept[_key(event.source)]]
        elif isinstance(event, TrainEvent) and event.step is not None and event.samples_per_source is not None:
            _count(seen, totals, event.step, event.samples_per_source)
        elif isinstance(event, TeachCheckEvent) and event.id is not None:
            checks[event.id] = event
        elif isinstance(event, TeachEvent) and event.id is not None and "margin" in (event.model_extra or {}):
            margins[event.id] = (event.model_extra or {})["margin"]
    if live_sources:
        sources = [dict(s) for s in live_sources if isinstance(s, dict)]
    for source in sources:
        source.setdefault("seen", int(totals.get(str(source.get("name")), 0)))
    inbox = [_inbox_entry(entry, checks.get(entry.id), margins.get(entry.id))
             for entry in read_inbox(inbox_path(folder.root))]
    return DataView(sources, seen, inbox)


def _inbox_entry(entry: InboxEntry, check: TeachCheckEvent | None, margin: Any) -> dict[str, Any]:
    """An inbox entry with its check (a preference's margins and preference are the check's extra
    fields, as the engine writes them; `margin`: its margin when it came in)."""
    extra = (check.model_extra or {}) if check is not None else {}
    learned = check.learned if check is not None else None
    if entry.rejected is not None and _real(extra.get("margin_after")):
        learned = extra["margin_after"] > 0  # a pair is learned when the model prefers its chosen answer
    return {**entry.to_dict(), "old": check.old if check is not None else None, "new": check.new if check is not None else None,
            "learned": learned, "checked_at": check.step if check is not None else None,
            "margin_before": extra.get("margin_before", margin),
            "margin_after": extra.get("margin_after"), "prefers": extra.get("prefers")}


def _count(seen: dict[str, list[Point]], totals: dict[str, float], step: int, drawn: dict[str, int]) -> None:
    """Add a train record's samples drawn per source to each source's running total at `step`."""
    for name, n in drawn.items():
        points = seen.setdefault(name, [])
        if points and points[-1][0] >= step:  # a rewind: the data position went back too
            while points and points[-1][0] >= step:
                points.pop()
            totals[name] = points[-1][1] if points else 0.0
        totals[name] = totals.get(name, 0.0) + n
        points.append((step, totals[name]))


def _key(where: object) -> str:
    """A checkpoint's or snapshot's name as events give it (a URL, a path, "snapshot:NAME")."""
    text = str(where or "")
    return text if text.startswith("snapshot:") else text.removeprefix("file://").rstrip("/").rsplit("/", 1)[-1]


def configured_sources(folder: RunFolder) -> list[dict]:
    """The sources the run started with, from its config.yaml: data.sources, or the one-source
    shorthand data.train (the embedded default task when empty)."""
    try:
        data = (yaml.safe_load(folder.config.read_text()) or {}).get("data") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    listed = data.get("sources") or []
    if listed:
        return [{"name": s.get("name") or Path(str(s.get("path", ""))).stem, "path": s.get("path"),
                 "format": s.get("format", "auto"), "weight": s.get("weight", 1.0)} for s in listed
                if isinstance(s, dict)]
    return [{"name": DEFAULT_SOURCE, "path": data.get("train") or "(the embedded default task)",
             "format": data.get("format", "auto"), "weight": 1.0}]


def margin_text(entry: dict) -> str:
    """A preference's log-probability margin of chosen over rejected when it came in and at its
    check, and which answer the model then prefers; empty for a taught answer."""
    before, after = entry.get("margin_before"), entry.get("margin_after")
    if not _real(before):
        return ""
    if not _real(after):
        return f"{before:+.3f} → (not checked yet)"
    return f"{before:+.3f} → {after:+.3f} (prefers {entry.get('prefers') or '?'})"


# the inbox's columns as both front ends show them: a taught answer fills "answer (chosen)", a
# preference also "rejected"; learned: for an answer, the answer after is the taught one, for a
# pair the model prefers the chosen answer at the check
INBOX_COLUMNS = ["id", "prompt", "answer (chosen)", "rejected", "step", "before", "after", "learned", "margin",
                 "removed"]


def inbox_rows(inbox: list[dict]) -> list[list[Any]]:
    """One row per inbox entry (DataView.inbox), in INBOX_COLUMNS' order."""
    return [[e["id"], readable_prompt(e["prompt"]), e["answer"], e.get("rejected") or "", e["step"],
             e.get("old") or "", e.get("new") or "",
             "" if e.get("learned") is None else ("yes" if e["learned"] else "not yet"),
             margin_text(e), "yes" if e.get("removed") else ""] for e in inbox]


def readable_prompt(prompt: str) -> str:
    """A prompt as the model saw it, for reading: its special tokens (BOS, the chat template's
    role markers) left out, its whitespace on one line."""
    return " ".join(SPECIAL_TOKEN.sub(" ", str(prompt)).split())


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(text: Any, what: str) -> float:
    """A weight typed in a box: a finite number >= 0, else ValueError naming `what`."""
    try:
        value = float(str(text).strip())
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{what} must be a number >= 0, got {str(text).strip()!r}")
    return value
