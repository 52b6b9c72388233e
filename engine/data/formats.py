"""Row formats: turning checked rows into (input_ids, labels). The formats, their rows and what
the loss is on are declared in `contract.data_rows` (torch-free, shared with the pre-flight check).

Special tokens follow the tokenizer: text and input are encoded with its special tokens (bos
where it adds one); an output is encoded without and followed by eos, so the model learns to
stop. The chat template decides a conversation's special tokens; pre-tokenized rows are taken
as they are. Labels of -100 are ignored by the loss.
"""

from __future__ import annotations

from typing import Any, Callable

# The torch-free half (formats, detection, checking one row) lives in the contract, shared with
# the pre-flight check (contract.preflight): one piece of code for one job.
from contract.data_rows import IGNORE, RowIssue
from engine.data.chat import ChatIssue, encode_chat
from engine.data.preference import encode_preference

Encoded = tuple[list[int], list[int]]  # (input_ids, labels)


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


# the preference formats encode to sample dicts of their own (engine.data.preference)
ENCODERS: dict[str, Callable[[Any, list], list[Any]]] = {
    "text": encode_text, "input_output": encode_input_output, "chat": encode_chats,
    "tokenized": encode_tokenized, "preference": encode_preference, "unpaired": encode_preference}
