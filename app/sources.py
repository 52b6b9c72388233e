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

from contract.inbox import inbox_path, read_inbox
from contract.run_folder import RunFolder, read_events
from contract.events import EventType

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


def data_view(folder: RunFolder, events: Iterable[dict] | None = None,
              live_sources: list[dict] | None = None) -> DataView:
    """The sources, samples drawn and inbox of the run in `folder`. `live_sources`: the sources
    as the running run says now (its `status`), which win over the event log's account."""
    events = read_events(folder.events) if events is None else events
    sources = configured_sources(folder)
    totals: dict[str, float] = {}
    seen: dict[str, list[Point]] = {}
    checks: dict[str, dict] = {}
    margins: dict[str, float] = {}  # a preference's margin when it came in (its teach event)
    # the sources as each checkpoint / snapshot recorded them: a rewind to one takes them back
    kept: dict[str, list[dict]] = {}
    for event in events:
        kind, step = event.get("type"), event.get("step")
        if kind == EventType.DATA and isinstance(event.get("sources"), list):
            sources = [dict(s) for s in event["sources"] if isinstance(s, dict)]
        elif kind in (EventType.CHECKPOINT, EventType.SNAPSHOT):
            kept[_key(event.get("path") if kind == EventType.CHECKPOINT else "snapshot:" + str(event.get("name")))] = \
                [dict(s) for s in sources]
        elif kind in (EventType.REWIND, EventType.BRANCH) and _key(event.get("source")) in kept:
            sources = [dict(s) for s in kept[_key(event.get("source"))]]
        elif kind == EventType.TRAIN and isinstance(step, int) and isinstance(event.get("samples_per_source"), dict):
            for name, n in event["samples_per_source"].items():
                if isinstance(n, (int, float)):
                    points = seen.setdefault(name, [])
                    if points and points[-1][0] >= step:  # a rewind: the data position went back too
                        while points and points[-1][0] >= step:
                            points.pop()
                        totals[name] = points[-1][1] if points else 0.0
                    totals[name] = totals.get(name, 0.0) + n
                    points.append((step, totals[name]))
        elif kind == EventType.TEACH_CHECK and isinstance(event.get("id"), str):
            checks[event["id"]] = event
        elif kind == EventType.TEACH and isinstance(event.get("id"), str) and "margin" in event:
            margins[event["id"]] = event["margin"]
    if live_sources:
        sources = [dict(s) for s in live_sources if isinstance(s, dict)]
    for source in sources:
        source.setdefault("seen", int(totals.get(str(source.get("name")), 0)))
    inbox = []
    for entry in read_inbox(inbox_path(folder.root)):
        check = checks.get(entry.id, {})
        learned = check.get("learned")
        if entry.rejected is not None and _real(check.get("margin_after")):
            learned = check["margin_after"] > 0  # a pair is learned when the model prefers its chosen answer
        inbox.append({**entry.to_dict(), "old": check.get("old"), "new": check.get("new"),
                      "learned": learned, "checked_at": check.get("step"),
                      "margin_before": check.get("margin_before", margins.get(entry.id)),
                      "margin_after": check.get("margin_after"), "prefers": check.get("prefers")})
    return DataView(sources, seen, inbox)


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
