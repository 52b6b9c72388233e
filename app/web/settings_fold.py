"""The Train tab's "More live settings" fold: a box per live setting of `set` but the learning
rate (its own box above) and the chat's generation defaults (app.live_settings: the command's
fields, its descriptions as help). Apply sends one `set` with the boxes that hold a value, at the
next step boundary, all or nothing (a refusal names the setting and the rule, and nothing
changes); the run's present values are shown when the fold opens and after each change (a GRPO
run's reward weights also as the hint of their box). Below, a GRPO run's reward functions: add one
(an entry as grpo.rewards takes one) or remove one by name, each at the next step boundary."""

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
    with gr.Accordion("More live settings: optimizer, clipping, intervals, preference beta, serving budget, "
                      "GRPO sampling and rewards", open=False, elem_id="train-settings") as fold:
        present = gr.Markdown("", elem_id="train-settings-present")
        boxes: dict[str, gr.Textbox] = {}
        names = live_settings.names()
        for row in range(0, len(names), 4):
            with gr.Row():
                for name in names[row:row + 4]:
                    boxes[name] = gr.Textbox(label=live_settings.label(name), value="", max_lines=1,
                                             info=live_settings.help_text(name), elem_id=f"train-set-{name}")
        apply = gr.Button("Apply at the next step", interactive=False, elem_id="train-settings-apply", elem_classes=[OPERATOR])
        with gr.Row():
            entry = gr.Textbox(label="Add a reward (GRPO)", value="", max_lines=1, elem_id="train-reward-entry",
                               placeholder="{kind: regex, pattern: 'a+', name: as, weight: 0.5}",
                               info="An entry as grpo.rewards takes one: a built-in kind, or function: "
                               "module:function / file.py:function.")
            gone = gr.Textbox(label="Remove a reward (GRPO)", value="", max_lines=1, elem_id="train-reward-name",
                              placeholder="its name", info="The reward's name (rewards/<name>/... in the metrics).")
        with gr.Row():
            add = gr.Button("Add reward", elem_id="train-reward-add", elem_classes=[OPERATOR])
            remove = gr.Button("Remove reward", elem_id="train-reward-remove", elem_classes=[OPERATOR])
        said = gr.Markdown("", elem_id="train-settings-result")
    weights = boxes["reward_weights"]

    def look(path: str | None) -> dict:
        return _shown(backend, path, present, weights)

    def send(path: str | None, *texts: str) -> dict:
        done = apply_boxes(backend, path, dict(zip(boxes, texts)))
        return {said: done, **_shown(backend, path, present, weights), **{box: "" for box in boxes.values()}}

    def adding(path: str | None, text: str) -> dict:
        return {said: add_reward(backend, path, text), entry: "", **_shown(backend, path, present, weights)}

    def removing(path: str | None, name: str) -> dict:
        return {said: remove_reward(backend, path, name), gone: "", **_shown(backend, path, present, weights)}

    fold.expand(readable(look), inputs=run_state, outputs=[present, weights], api_visibility="private",
                show_progress="hidden")
    apply.click(readable(send), inputs=[run_state, *boxes.values()], outputs=[said, present, *boxes.values()],
                api_visibility="private", concurrency_limit=None)
    add.click(readable(adding), inputs=[run_state, entry], outputs=[said, entry, present, weights],
              api_visibility="private", concurrency_limit=None)
    remove.click(readable(removing), inputs=[run_state, gone], outputs=[said, gone, present, weights],
                 api_visibility="private", concurrency_limit=None)
    return apply


def _shown(backend: Backend, path: str | None, present: gr.Markdown, weights: gr.Textbox) -> dict:
    """The present values, and a GRPO run's reward weights as their box's hint."""
    text, settings = _present(backend, path)
    return {present: text, weights: gr.Textbox(placeholder=live_settings.weights_hint(settings))}


def present_text(backend: Backend, path: str | None) -> str:
    """The run's values now, from its status (one line), or why there are none."""
    return _present(backend, path)[0]


def _present(backend: Backend, path: str | None) -> tuple[str, dict | None]:
    try:
        if not backend.session.info(backend.session.resolve(path)).alive:
            return "*The run is not live: nothing to show or change.*", None
        settings = backend.verbs(path).status().settings
    except SessionError as e:
        return f"*No values to show: {html.escape(str(e))}*", None
    shown = live_settings.present(settings)
    text = "Now: " + " · ".join(f"{name} **{html.escape(value)}**" for name, value in shown) if shown else ""
    return text, settings


def apply_boxes(backend: Backend, path: str | None, texts: dict[str, str]) -> str:
    """Send the filled boxes as one `set`; the page's words for the run's answer."""
    answer = backend.verbs(path).set(**live_settings.changes(texts))
    changed = ", ".join(f"{live_settings.label(k)} {html.escape(live_settings.shown(v))}"
                        for k, v in answer.changes.items())
    return f"**Set** at step {answer.step}, from step {answer.applies_from_step} on: {changed}."


def add_reward(backend: Backend, path: str | None, text: str) -> str:
    """Send the typed entry as `add_reward`; the page's words for the run's answer."""
    answer = backend.verbs(path).add_reward(live_settings.reward_entry(text))
    return f"**Reward added** at step {answer.step}, from step {answer.applies_from_step} on: {_rewards(answer.rewards)}."


def remove_reward(backend: Backend, path: str | None, name: str) -> str:
    """Send `remove_reward` for the typed name; the page's words for the run's answer."""
    if not str(name or "").strip():
        raise SessionError("type the name of the reward to remove")
    answer = backend.verbs(path).remove_reward(str(name).strip())
    return f"**Reward removed** at step {answer.step}, from step {answer.applies_from_step} on: {_rewards(answer.rewards)}."


def _rewards(entries: list[dict]) -> str:
    return ", ".join(f"{html.escape(str(e.get('name')))} x{live_settings.shown(float(e.get('weight', 1.0)))}"
                     for e in entries)
