"""The chat beside the plots: a side panel of the Train tab that stays in view while
the run trains. It is the Chat tab's chat, smaller: the same handler (`chat._respond`, through
the shared session's streaming chat), the same header (`chat.header`), which the page's live
feed keeps current ("running, step N"; feed.py: nothing else is polled for it), and, for
the embedded default, the note on its early answers with the answers it should come to give
(app.embedded), and the A/B fold ("Which answer is better?", app.web.chat_prefer: B is another
sample, the chosen pair recorded in this chat). Settings, comparing and Teach stay in the Chat tab."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from app.embedded import early_note
from app.web import chat, chat_prefer
from app.web.backend import Backend
from app.web.widgets import CHAT_CLASS

MAX_NEW_TOKENS = 32  # the embedded default's answers are a word; the Chat tab has the slider


@dataclass
class SidePanel:
    """The components the Train tab's tick updates (`note` with the run it shows)."""
    column: gr.Column
    header: gr.Markdown
    note: gr.Markdown


def build(backend: Backend, run_state: gr.State) -> SidePanel:
    """The panel, in a column the caller's row places beside the plots."""
    with gr.Column(scale=2, min_width=320, elem_id="side-chat") as column:
        header = gr.Markdown("No run yet: press Start, then ask the model anything while it trains.",
                             elem_id="side-chat-about")
        note = gr.Markdown("", elem_id="side-chat-note", visible=False)
        live = gr.Chatbot(label=chat.LIVE, height=330, elem_id="side-chat-live", buttons=["copy"],
                          elem_classes=[CHAT_CLASS],
                          placeholder="Ask the model something while it trains: it answers from the weights "
                                      "of the next step.", feedback_options=None)
        with gr.Row(equal_height=True):
            message = gr.Textbox(placeholder="e.g. reverse: hello", show_label=False, scale=4, max_lines=3,
                                 elem_id="side-chat-input", submit_btn=False)
            send = gr.Button("Send", variant="primary", scale=1, min_width=70, elem_id="side-chat-send")
        sample = gr.Checkbox(False, label="Sample (temperature 1) instead of the most likely answer",
                             elem_id="side-chat-sample")
        # the side chat's own settings for its A/B (samples at temperature 1 whatever these say)
        fixed = [gr.Number(value, visible=False) for value in (MAX_NEW_TOKENS, 1.0, 1.0, 0, 1.0)]
        chat_prefer.build(backend, run_state, None, fixed, live, prefix="side-prefer")
    view = chat.ChatView(message, live, None, header, note_default=False)

    def respond(text: str, history: list, path: str | None, sampled: bool):
        temperature = 1.0 if sampled else 0.0
        yield from chat._respond(backend, view, text, history, [], path, MAX_NEW_TOKENS, temperature,
                                 1.0, 0, 1.0, False, False)

    for trigger in (send.click, message.submit):
        trigger(respond, inputs=[message, live, run_state, sample], outputs=[message, live, header],
                concurrency_limit=None, show_progress="hidden", api_visibility="private")
    return SidePanel(column, header, note)


def note_update(backend: Backend, path: str) -> dict:
    """The side panel's note for the run at `path`: the embedded default's (app.embedded), shown
    for such a run only."""
    default = backend.watch.embedded(path)
    return gr.update(value=early_note(default.objective) if default is not None else "", visible=default is not None)
