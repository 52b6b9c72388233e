"""Data rows without a tokenizer: detecting their format, checking one row (the rows of a file
are contract.data_files'). Torch-free, so that the pre-flight check (contract.preflight) and the engine's
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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

IGNORE = -100
FORMATS = ("text", "input_output", "chat", "tokenized", "preference", "unpaired", "prompt")
PREFERENCE_FORMATS = ("preference", "unpaired")  # rows of pairs / judged answers, not of text
# Detection order: a row with {"messages"} is chat even if it also has a "text" field, etc.
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",), "tokenized": ("input_ids",), "input_output": ("input", "output"),
    "text": ("text",), "preference": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"), "prompt": ("prompt",)}  # prompt last: the others have one too
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
