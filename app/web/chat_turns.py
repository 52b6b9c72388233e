"""How the chat views read their own turns (Gradio's Chatbot messages): a message's text, the tag
under an answer (the step it came from and the weights that gave it), and the messages a question
is sent with. Shared by the Chat tab (app.web.chat) and its rating of an answer (chat_rate)."""

from __future__ import annotations

import re
from typing import Any

TAG = re.compile(r"\n\n<sub>step (\d+) · [^<]*</sub>$")  # what tagged() puts under an answer
EMPTY = "(empty answer)"


def tagged(text: str, step: int | None, what: str) -> str:
    """An answer as the chat shows it: its text and, once complete, the step and weights tag."""
    if step is None:
        return text or "…"
    return f"{text or EMPTY}\n\n<sub>step {step} · {what}</sub>"


def text_of(content: Any) -> str:
    """A Chatbot message's text (Gradio hands content over as a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, list):
        return "".join(text_of(part) for part in content)
    return ""


def sent_messages(chat: list, text: str, with_history: bool) -> list[dict]:
    """What the model is sent: this question, and with `with_history` the earlier turns
    (without the step tags the page added)."""
    turns = []
    if with_history:
        for m in chat:
            content = TAG.sub("", text_of(m.get("content")))
            if m.get("role") in ("user", "assistant") and content and not content.startswith("⚠"):
                turns.append({"role": m["role"], "content": content})
    return turns + [{"role": "user", "content": text}]
