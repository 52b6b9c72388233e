"""The Train tab's "More live settings" fold: a box per live setting of `set` but the learning
rate (its own box above) and the chat's generation defaults (app.live_settings: the command's
fields, its descriptions as help). Apply sends one `set` with the boxes that hold a value, at the
next step boundary, all or nothing (a refusal names the setting and the rule, and nothing
changes); the run's present values are shown when the fold opens and after each change."""

from __future__ import annotations

import html

import gradio as gr

from app import live_settings
from app.session import SessionError
from app.web.access import OPERATOR
from app.web.backend import Backend
from app.web.widgets import readable


def build(backend: Backend, run_state: gr.State) -> gr.Button:
    """The fold; returns its Apply button, which the Train tab enables with its other buttons
    (when the run's state and the login allow `set`)."""
    with gr.Accordion("More live settings: optimizer, clipping, intervals, preference beta, serving budget",
                      open=False, elem_id="train-settings") as fold:
        present = gr.Markdown("", elem_id="train-settings-present")
        boxes: dict[str, gr.Textbox] = {}
        names = live_settings.names()
        for row in range(0, len(names), 4):
            with gr.Row():
                for name in names[row:row + 4]:
                    boxes[name] = gr.Textbox(label=live_settings.label(name), value="", max_lines=1,
                                             info=live_settings.help_text(name), elem_id=f"train-set-{name}")
        apply = gr.Button("Apply at the next step", interactive=False, elem_id="train-settings-apply", elem_classes=[OPERATOR])
        said = gr.Markdown("", elem_id="train-settings-result")

    def look(path: str | None) -> str:
        return present_text(backend, path)

    def send(path: str | None, *texts: str) -> dict:
        done = apply_boxes(backend, path, dict(zip(boxes, texts)))
        return {said: done, present: present_text(backend, path), **{box: "" for box in boxes.values()}}

    fold.expand(readable(look), inputs=run_state, outputs=present, api_visibility="private", show_progress="hidden")
    apply.click(readable(send), inputs=[run_state, *boxes.values()], outputs=[said, present, *boxes.values()],
                api_visibility="private", concurrency_limit=None)
    return apply


def present_text(backend: Backend, path: str | None) -> str:
    """The run's values now, from its status (one line), or why there are none."""
    try:
        if not backend.session.info(backend.session.resolve(path)).alive:
            return "*The run is not live: nothing to show or change.*"
        settings = backend.verbs(path).status().settings
    except SessionError as e:
        return f"*No values to show: {html.escape(str(e))}*"
    shown = live_settings.present(settings)
    return "Now: " + " · ".join(f"{name} **{html.escape(value)}**" for name, value in shown) if shown else ""


def apply_boxes(backend: Backend, path: str | None, texts: dict[str, str]) -> str:
    """Send the filled boxes as one `set`; the page's words for the run's answer."""
    answer = backend.verbs(path).set(**live_settings.changes(texts))
    changed = ", ".join(f"{live_settings.label(k)} {html.escape(live_settings.shown(v))}"
                        for k, v in answer.changes.items())
    return f"**Set** at step {answer.step}, from step {answer.applies_from_step} on: {changed}."
