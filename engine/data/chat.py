"""Which tokens of a chat are the assistant's: the ones the loss is computed on.

Two ways, both ending in a per-token mask over the conversation rendered by the tokenizer's own
chat template:

* the template marks assistant text with ``{% generation %}`` ... ``{% endgeneration %}``:
  transformers' ``return_assistant_tokens_mask`` uses those marks;
* otherwise the conversation is rendered prefix by prefix. An assistant turn at index i spans
  the characters from the end of ``render(messages[:i], add_generation_prompt=True)`` (the
  assistant header belongs to the prompt) to the end of ``render(messages[:i + 1])`` (its
  end-of-turn marker belongs to the answer: the model must learn to stop). Each prefix must be a
  prefix of the full rendering; a template that rewrites earlier turns (e.g. drops reasoning once
  a later turn follows) fails that check and the row is reported, never guessed at.
"""

from __future__ import annotations

import re

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatIssue(Exception):
    """A conversation whose assistant tokens cannot be found (reported as a bad row)."""


def has_generation_marks(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(GENERATION_TAG.search(template))


def encode_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids, mask with 1 on assistant tokens) of one conversation."""
    if has_generation_marks(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    text, spans = _assistant_spans(tokenizer, messages)
    if not getattr(tokenizer, "is_fast", False):
        raise ChatIssue("the chat format needs a fast tokenizer (for character offsets) or a chat "
                        "template with {% generation %} marks")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(start < b and end > a for a, b in spans)) for start, end in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def _assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[:i + 1])
        if not (full.startswith(prompt) and full.startswith(through) and len(through) >= len(prompt)):
            raise ChatIssue(f"the chat template renders turns before message {i} differently when "
                            "later turns follow, so the assistant tokens cannot be located; use a "
                            "template with {% generation %} marks")
        spans.append((len(prompt), len(through)))
    return full, spans
