"""A GRPO run's latest samples and its ratings as every front end shows them (docs/rewards.md,
"Samples and ratings"): the rows of the table (the web Train tab's Dataframe, the notebook panel's
HTML table), its caption, the ratings a person may forget, and the words of a rating's answer.
Built from the `samples` event (contract.events.SamplesEvent) the run's history keeps
(app.series.RunHistory.samples) and from the run's inbox; the rating itself goes through the one
set of verbs (`rate`, `rate_chat`, `forget`: supervisor.client.Verbs). Torch-free, Gradio-free, ipywidgets-free.

    table = samples_table(history.samples)   # None before the first GRPO step: an empty table
    table.columns, table.rows, table.caption, table.step
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.events import EventError, SamplesEvent
from contract.inbox import inbox_path, read_ratings
from contract.protocol.data_commands import ForgetAnswer
from contract.protocol.rating_commands import DOWN, UP, RateAnswer, RateChatAnswer

FIRST = ["#", "group", "row", "prompt", "completion"]  # the columns before the reward functions'
LAST = ["total", "advantage", "clipped"]               # and after them
DIGITS = 4  # a score's decimals as shown (the event keeps them all)
NO_SAMPLES = "No samples yet: a GRPO run (objective=grpo) shows its latest step's samples here after each step."


@dataclass(frozen=True)
class SamplesTable:
    """The latest step's samples as rows under `columns` (one column per reward function between
    the texts and the total); `step` is the one a rating names with a row's `#` (None: no samples)."""
    step: int | None
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    caption: str = NO_SAMPLES
    rewards: list[str] = field(default_factory=list)


def samples_table(record: SamplesEvent | dict | None) -> SamplesTable:
    """The table of one `samples` event (a model, or its record as the log holds it); an empty
    table with a note when there is none (not a GRPO run, or no step yet) or it is unreadable."""
    if record is None:
        return SamplesTable(None, FIRST + LAST)
    try:
        event = record if isinstance(record, SamplesEvent) else SamplesEvent.model_validate(record)
    except (EventError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        return SamplesTable(None, FIRST + LAST, caption=f"The latest samples event cannot be read: {e}")
    samples = event.samples or []
    names = list(dict.fromkeys(name for s in samples for name in s.rewards))  # in the run's order
    rows = [[s.number, s.group, s.row, s.prompt, s.completion, *(_score(s.rewards.get(n)) for n in names),
             _score(s.total), _score(s.advantage), s.clipped] for s in samples]
    return SamplesTable(event.step, FIRST + names + LAST, rows, caption_of(event), names)


def caption_of(event: SamplesEvent) -> str:
    """What the table holds: the step, how many of its samples, how texts are cut, how to rate."""
    shown, count = len(event.samples or []), event.count if event.count is not None else len(event.samples or [])
    of = f"all {count}" if shown >= count else f"the first {shown} of {count}"
    cut = f"; texts cut at {event.text_limit} characters" if event.text_limit else ""
    return (f"Step {event.step}: {of} samples{cut}. Rate one (up, down, or a score in [-1, 1]) by its #: "
            f"its group is trained once more at the next step with a 'human' reward.")


def sorted_rows(table: SamplesTable, column: str, descending: bool = False) -> list[list[Any]]:
    """`table`'s rows ordered by `column` (None last, either way); unknown column: as they are."""
    if column not in table.columns:
        return list(table.rows)
    at = table.columns.index(column)
    present = [r for r in table.rows if r[at] is not None]
    missing = [r for r in table.rows if r[at] is None]
    return sorted(present, key=lambda r: r[at], reverse=descending) + missing


@dataclass(frozen=True)
class Given:
    """A rating in the run's inbox, as the forget picker lists it."""
    id: str
    label: str
    forgotten: bool


def ratings(folder: str | Path) -> list[Given]:
    """The ratings in the inbox of the run in `folder`, in the order given."""
    return [Given(r["id"], rating_label(r), r["forgotten_at"] is not None) for r in read_ratings(inbox_path(Path(folder)))]


def rating_label(record: dict) -> str:
    """A rating as a picker lists it: `t3: step 2 #5 up · "4" (given at step 2)`; a chat answer's:
    `t4: chat (step 2) down · "cba" (given at step 3)`."""
    completion = " ".join(str(record.get("completion", "")).split())
    completion = completion if len(completion) <= 30 else completion[:29] + "…"
    which = f"chat (step {record.get('answer_step')})" if record.get("chat") else \
        f"step {record.get('sample_step')} #{record.get('sample')}"
    label = (f"{record['id']}: {which} {score_word(record['score'])}"
             f" · \"{completion}\" (given at step {record.get('step')})")
    return label + (f", forgotten at step {record['forgotten_at']}" if record.get("forgotten_at") is not None else "")


def score_word(score: float) -> str:
    """up, down, or the score."""
    return "up" if score == UP else "down" if score == DOWN else f"{score:g}"


def rated_text(answer: RateAnswer) -> str:
    """The answer to a rating, in words."""
    return (f"Rated sample #{answer.sample} of step {answer.sample_step} {score_word(answer.score)} "
            f"({answer.id}): its group ({answer.group}) is trained again at step {answer.applies_from_step} "
            f"with a 'human' reward. Forget {answer.id} to take it back.")


def rated_chat_text(answer: RateChatAnswer) -> str:
    """The answer to a rating of a chat answer, in words."""
    return (f"Rated the chat's answer of step {answer.answer_step} {score_word(answer.score)} ({answer.id}): at step "
            f"{answer.applies_from_step} it trains with {answer.group_size - 1} fresh answers to the same question "
            f"as a group, with a 'human' reward (the fresh ones 0). Forget {answer.id} to take it back.")


def forgot_text(answer: ForgetAnswer) -> str:
    """The answer to forgetting a rating, in words."""
    return f"Forgotten {answer.id}: nothing of it trains from step {answer.applies_from_step} on."


def _score(value: float | None) -> float | None:
    return None if value is None else round(float(value), DIGITS)
