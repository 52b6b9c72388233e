"""The Chat tab's rating of an answer, for a GRPO run (docs/rewards.md, "Rating a chat answer"):
Up or Down on the chat's last answer. The question (with the earlier turns when the chat sends
them) and the answer as it came back go through the one set of verbs (`rate_chat`:
supervisor.client.Verbs); the run keeps it in its inbox before it answers, and its next step
samples fresh answers to the same question and trains them with the rated one as a group. The
fold shows only for a GRPO run; the answer or the refusal is written under the buttons."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from app.samples import rated_chat_text
from app.session import SessionError
from app.web.access import OPERATOR
from app.web.backend import Backend
from app.web.chat_turns import EMPTY, TAG, sent_messages, text_of
from contract.config.load import load_config
from contract.config.schema import ConfigError

_GRPO: dict[str, bool] = {}  # run folder -> whether it is a GRPO run (its config does not change)


def build(backend: Backend, run_state: gr.State, live: gr.Chatbot, history: gr.Checkbox) -> gr.Accordion:
    """The fold under the chat (hidden until the run shown is a GRPO run); returns it."""
    with gr.Accordion("Rate the last answer (a GRPO run): a human reward for it against fresh samples",
                      open=True, visible=False, elem_id="chat-rate-fold") as fold:
        with gr.Row(equal_height=True):
            up = gr.Button("👍 Up", scale=1, elem_id="chat-rate-up", elem_classes=[OPERATOR])
            down = gr.Button("👎 Down", scale=1, elem_id="chat-rate-down", elem_classes=[OPERATOR])
        result = gr.Markdown("The next step samples fresh answers to the same question with the live weights "
                             "and trains them with the rated one as a group: up raises its likelihood against "
                             "theirs, down lowers it.", elem_id="chat-rate-result")
    for button, score in ((up, "up"), (down, "down")):
        button.click(lambda path, chat, turns, score=score: rate_last(backend, path, chat, bool(turns), score),
                     inputs=[run_state, live, history], outputs=result, api_visibility="private",
                     concurrency_limit=None)
    return fold


def shown(backend: Backend, path: str | None, fold: gr.Accordion) -> dict:
    """The fold's visibility for the run `path` names."""
    try:
        resolved = backend.session.resolve(path)
    except SessionError:
        return {fold: gr.update(visible=False)}
    return {fold: gr.update(visible=is_grpo(resolved))}


def is_grpo(path: str) -> bool:
    """Whether the run in folder `path` trains with GRPO (read from its config once)."""
    if path not in _GRPO:
        try:
            _GRPO[path] = load_config(Path(path) / "config.yaml").preference.objective == "grpo"
        except (ConfigError, OSError, ValueError):
            return False
    return _GRPO[path]


def last_answer(chat: list, with_history: bool) -> tuple[list[dict], str, int | None] | None:
    """(the messages the chat sent for its last answer, that answer's text, its step), or None
    when the chat has no finished answer of the live weights."""
    turns = list(chat or [])
    if len(turns) < 2 or turns[-1].get("role") != "assistant" or turns[-2].get("role") != "user":
        return None
    shown_text = text_of(turns[-1].get("content"))
    found = TAG.search(shown_text)
    if found is None:  # still streaming, or a refusal (⚠)
        return None
    answer = shown_text[:found.start()]
    answer = "" if answer == EMPTY else answer
    return sent_messages(turns[:-2], text_of(turns[-2].get("content")), with_history), answer, int(found.group(1))


def rate_last(backend: Backend, path: str | None, chat: list, with_history: bool, score: str) -> str:
    """Rate the chat's last answer through the verbs: the answer in words, or the refusal."""
    last = last_answer(chat, with_history)
    if last is None:
        raise gr.Error("Ask something and wait for the whole answer first.", print_exception=False)
    messages, answer, step = last
    verbs = backend.verbs(path)
    try:
        try:
            result = verbs.rate_chat(None, answer, score, messages=messages, step=step)
        except SessionError as e:  # a model without a chat template: the chat sent the raw text
            if "chat template" not in str(e):
                raise
            result = verbs.rate_chat(messages[-1]["content"], answer, score, step=step)
    except SessionError as e:
        return f"**Not rated**: {e}"
    return rated_chat_text(result)

