"""Row formats: checking one row and turning rows into (input_ids, labels).

=============  ==========================================  ===================================
format         row                                         loss on
=============  ==========================================  ===================================
text           {"text"}                                    every token
input_output   {"input", "output"}                         the output tokens (+ eos)
chat           {"messages": [{"role", "content"}, ...]}    assistant turns (chat template)
tokenized      {"input_ids", "labels"?}                    labels (default: input_ids)
=============  ==========================================  ===================================

Special tokens follow the tokenizer: text and input are encoded with its special tokens (bos
where it adds one); an output is encoded without and followed by eos, so the model learns to
stop. The chat template decides a conversation's special tokens; pre-tokenized rows are taken
as they are. Labels of -100 are ignored by the loss.
"""

from __future__ import annotations

from typing import Any, Callable

from engine.data.chat import ChatIssue, encode_chat

IGNORE = -100
FORMATS = ("text", "input_output", "chat", "tokenized")
# Detection order: a row with {"messages"} is chat even if it also has a "text" field, etc.
FORMAT_KEYS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",), "tokenized": ("input_ids",), "input_output": ("input", "output"),
    "text": ("text",)}

Encoded = tuple[list[int], list[int]]  # (input_ids, labels)


class RowIssue(Exception):
    """Why one row cannot be used: a short reason category and a sentence naming the field."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def detect_format(row: Any) -> str | None:
    """The format whose keys `row` has (None values count as absent: Arrow fills missing keys
    with None), or None when it has none of them."""
    if not isinstance(row, dict):
        return None
    for fmt, keys in FORMAT_KEYS.items():
        if all(row.get(k) is not None for k in keys):
            return fmt
    return None


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


CHECKS: dict[str, Callable[[Any], Any]] = {
    "text": check_text, "input_output": check_input_output, "chat": check_chat,
    "tokenized": check_tokenized}


# -- encoding checked rows (batched where the tokenizer allows) ---------------------------------

def adds_eos(tokenizer) -> bool:
    """Whether the tokenizer already ends every encoded text with eos (T5-style)."""
    ids = tokenizer("a")["input_ids"]
    return tokenizer.eos_token_id is not None and bool(ids) and ids[-1] == tokenizer.eos_token_id


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def encode_text(tokenizer, texts: list[str]) -> list[Encoded | RowIssue]:
    tail = [] if adds_eos(tokenizer) else _eos(tokenizer)
    out = []
    for ids in tokenizer(texts)["input_ids"]:
        ids = list(ids) + tail
        out.append((ids, list(ids)))
    return out


def encode_input_output(tokenizer, pairs: list[tuple[str, str]]) -> list[Encoded | RowIssue]:
    strip_eos = adds_eos(tokenizer)  # the prompt must not end the sequence
    prompts = tokenizer([p for p, _ in pairs])["input_ids"]
    answers = tokenizer([a for _, a in pairs], add_special_tokens=False)["input_ids"]
    eos, out = _eos(tokenizer), []
    for prompt, answer in zip(prompts, answers):
        prompt = list(prompt[:-1] if strip_eos and prompt else prompt)
        answer = list(answer) + eos
        out.append((prompt + answer, [IGNORE] * len(prompt) + answer))
    return out


def encode_chats(tokenizer, conversations: list[list[dict]]) -> list[Encoded | RowIssue]:
    out: list[Encoded | RowIssue] = []
    for messages in conversations:
        try:
            ids, mask = encode_chat(tokenizer, messages)
        except ChatIssue as e:
            out.append(RowIssue("chat template", str(e)))
            continue
        except Exception as e:  # a Jinja template can raise anything (raise_exception, ...)
            out.append(RowIssue("chat template", f"the chat template failed: {type(e).__name__}: {e}"))
            continue
        out.append((ids, [t if m else IGNORE for t, m in zip(ids, mask)]))
    return out


def encode_tokenized(tokenizer, rows: list[tuple[list[int], list[int]]]) -> list[Encoded | RowIssue]:
    vocab = len(tokenizer)
    out: list[Encoded | RowIssue] = []
    for ids, labels in rows:
        if any(not 0 <= t < vocab for t in ids):
            out.append(RowIssue("token out of range", f"'input_ids' holds ids outside the "
                                f"tokenizer's vocabulary [0, {vocab})"))
        elif any(not (t == IGNORE or 0 <= t < vocab) for t in labels):
            out.append(RowIssue("token out of range", f"'labels' holds values that are neither "
                                f"{IGNORE} nor ids in [0, {vocab})"))
        else:
            out.append((ids, labels))
    return out


ENCODERS: dict[str, Callable[[Any, list], list[Encoded | RowIssue]]] = {
    "text": encode_text, "input_output": encode_input_output, "chat": encode_chats,
    "tokenized": encode_tokenized}
