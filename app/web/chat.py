"""The Chat tab: talk to the model while it trains (the live weights in the engine), tokens
streaming in; generation settings; the base model's answer side by side when a PEFT adapter
trains; each answer tagged with the training step and the branch it came from. Works while
paused. For the embedded default, the header says its early answers are empty or garbage, gives
the answers it learns to give and its held-out exact match (app.embedded), and an answer to one
of those questions is tagged with the expected answer. The same handler and header serve the
Train tab's chat beside the plots (chat_side).

Compare: another run, or any branch's checkpoint, answers the same question in a
column beside the live model, each answer labelled with where it came from: a live run with its
own live weights; a checkpoint or a run that has ended from a chat-only copy (`Session.chat_with`:
its own processes, stopped with "End it"). Teach: pick any answer of the chat, write
the answer you wanted, press Teach: the pair goes into the run's inbox and into the next batches
(the inbox is on the Train tab's data panel, with the engine's check of the answer before and
after). Which answer is better: one question answered twice, the better one preferred
(chat_prefer). Rate (a GRPO run): up or down on the last answer, a human reward for it against fresh
samples of the same question at the next step (chat_rate)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app.branches import checkpoint_targets
from app.embedded import early_note, expected_answer
from app.session import SessionError
from app.web.access import OPERATOR
from app.web import chat_prefer, chat_rate
from app.web.chat_turns import sent_messages, tagged, text_of
from app.web.backend import Backend
from app.web.backend.watch import Snapshot
from app.web.widgets import CHAT_CLASS, readable
from contract.branches import BranchTree

LIVE = "Live model (the weights being trained)"


def build(backend: Backend, run_state: gr.State) -> dict:
    about = gr.Markdown("", elem_id="chat-about")
    with gr.Row(equal_height=True):
        live = gr.Chatbot(label=LIVE, height=420, elem_id="chat-live", elem_classes=[CHAT_CLASS],
                          buttons=["copy"], placeholder="Ask the model something while it trains.",
                          feedback_options=None)
        base = gr.Chatbot(label="Base model (adapter off)", height=420, elem_id="chat-base", elem_classes=[CHAT_CLASS],
                          visible=False, buttons=["copy"], feedback_options=None)
        other = gr.Chatbot(label="Compared with", height=420, elem_id="chat-ckpt-answers", elem_classes=[CHAT_CLASS],
                           visible=False, buttons=["copy"], feedback_options=None)
    with gr.Accordion("Compare: another run, or a checkpoint of any branch, answers the same question beside "
                      "the live model", open=False, elem_id="chat-ckpt-fold"):
        with gr.Row(equal_height=True):
            ckpt = gr.Dropdown([], label="Compare with (a checkpoint, or another run)", scale=3, elem_id="chat-ckpt")
            ckpt_start = gr.Button("Compare", scale=1, elem_id="chat-ckpt-start")
            ckpt_stop = gr.Button("End it", scale=1, elem_id="chat-ckpt-stop")
        ckpt_note = gr.Markdown("Another live run answers with its own live weights. A checkpoint, or a run that "
                                "has ended, answers from a chat-only copy: a run of its own (its own layout and "
                                "memory) that trains nothing and ends with *End it*.", elem_id="chat-ckpt-note")
    copy = gr.State(None)  # {"path", "label"} of the chat-only copy this page compares with
    with gr.Row(equal_height=True):
        message = gr.Textbox(placeholder="e.g. reverse: hello", show_label=False, scale=6,
                             elem_id="chat-input", max_lines=4, submit_btn=False)
        send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
        clear = gr.Button("Clear", scale=1, elem_id="chat-clear")
    with gr.Accordion("Generation settings", open=False, elem_id="chat-settings"):
        with gr.Row():
            max_new = gr.Slider(1, 512, value=64, step=1, label="max_new_tokens", elem_id="chat-max-new")
            temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0: greedy)",
                                    elem_id="chat-temperature")
            top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top_p")
        with gr.Row():
            top_k = gr.Number(0, precision=0, label="top_k (0: off)")
            repetition = gr.Slider(0.5, 2.0, value=1.0, step=0.05, label="repetition_penalty")
            history = gr.Checkbox(False, label="Send earlier turns too",
                                  info="Off: each question alone (the embedded default model was trained on single instructions).")
        compare = gr.Checkbox(False, label="Compare with the base model", interactive=False,
                              elem_id="chat-compare",
                              info="Only when the run trains a PEFT adapter: the same question answered with the adapter off.")

    with gr.Accordion("Teach: write the answer you wanted to any question above", open=False,
                      elem_id="chat-teach-fold"):
        with gr.Row(equal_height=True):
            asked = gr.Dropdown([], label="The question whose answer to correct", scale=2,
                                elem_id="chat-teach-which")
            wanted = gr.Textbox(label="The answer you wanted", max_lines=4, scale=3, elem_id="chat-teach-answer")
            teach = gr.Button("Teach", variant="primary", scale=1, elem_id="chat-teach", elem_classes=[OPERATOR])
        taught = gr.Markdown("", elem_id="chat-teach-result")
    chat_prefer.build(backend, run_state, copy, [max_new, temperature, top_p, top_k, repetition], live)
    settings = [max_new, temperature, top_p, top_k, repetition, history, compare]
    rate_fold = chat_rate.build(backend, run_state, live, history)  # shown for a GRPO run

    view = ChatView(message, live, base, about, other)

    def respond(text: str, chat: list, base_chat: list, path: str | None, copied: dict | None,
                other_chat: list, *opts: Any):
        yield from _respond(backend, view, text, chat, base_chat, path, *opts)
        if copied:
            yield from _respond_copy(backend, view, text, other_chat, copied, *opts)

    for trigger in (send.click, message.submit):
        trigger(respond, inputs=[message, live, base, run_state, copy, other, *settings],
                outputs=[message, live, base, about, other], concurrency_limit=None, show_progress="hidden",
                api_visibility="private")
    def compare_with(choice: str | None, old: dict | None, path: str | None) -> dict:
        return {**start_copy(backend, choice, old, copy, other, ckpt_note), live: gr.update(label=live_label(backend, path))}

    ckpt_start.click(readable(compare_with), inputs=[ckpt, copy, run_state],
                     outputs=[copy, other, ckpt_note, live], api_visibility="private")
    ckpt_stop.click(readable(lambda old: {**stop_copy(backend, old, copy, other, ckpt_note), live: gr.update(label=LIVE)}),
                    inputs=copy, outputs=[copy, other, ckpt_note, live], api_visibility="private")
    clear.click(lambda: {live: [], base: []}, outputs=[live, base], api_visibility="private")
    live.change(lambda chat: gr.update(choices=questions(chat), value=(questions(chat) or [None])[-1]),
                inputs=live, outputs=asked, trigger_mode="always_last", show_progress="hidden",
                api_visibility="private")
    teach.click(lambda path, q, a: teach_answer(backend, path, q, a, taught, wanted), inputs=[run_state, asked, wanted],
                outputs=[taught, wanted], api_visibility="private", concurrency_limit=None)
    compare.change(lambda on: gr.update(visible=on), inputs=compare, outputs=base, api_visibility="private")
    refresh = dict(fn=lambda path: {**_about(backend, path, about, compare), ckpt: _checkpoints(backend, path),
                                    **chat_rate.shown(backend, path, rate_fold)},
                   inputs=run_state, outputs=[about, compare, ckpt, rate_fold],
                   api_visibility="private", show_progress="hidden")
    run_state.change(**refresh)
    return refresh  # the app also runs it when the tab is selected


@dataclass
class ChatView:
    """The components an answer updates as it streams in."""
    message: gr.Textbox
    live: gr.Chatbot
    base: gr.Chatbot | None
    about: gr.Markdown
    other: gr.Chatbot | None = None
    note_default: bool = True  # the header carries app.embedded's note (the side panel shows it apart)


def _about(backend: Backend, path: str | None, about: gr.Markdown, compare: gr.Checkbox) -> dict:
    """The header line and note; whether comparing with the base model makes sense."""
    adapter = backend.watch.trains_adapter(path)
    return {about: about_text(backend, path), compare: gr.update(interactive=adapter, value=False) if not adapter
            else gr.update(interactive=True)}


def about_text(backend: Backend, path: str | None, with_note: bool = True) -> str:
    """The chat views' header (`header`) of the run `path` names (None: the current run), with
    `with_note` the embedded default's note (app.embedded) under it; or why there is no run."""
    try:
        path = path or backend.session.default_run()
        if not path:
            return "No run yet: start one in the Configure tab."
        snap = backend.watch.snapshot(path)
    except SessionError as e:
        return str(e)
    text = header(backend, snap)
    default = backend.watch.embedded(snap.path)
    if with_note and default is not None:
        text += "\n\n" + early_note(default.objective)
    return text


def header(backend: Backend, snap: Snapshot) -> str:
    """"Talking to run NAME — running, step N / T." (and, for the embedded default, its held-out
    exact match so far): the chat views' header, which the page's live feed (feed.py) keeps
    current on the Chat tab and beside the plots."""
    p = snap.progress
    text = f"Talking to run **{snap.info.name}** — {p.state}, step {p.step}{f' / {p.total}' if p.total else ''}."
    if not snap.info.alive:
        text += " It has ended, so it cannot answer any more; start or reattach a run that is going."
    default = backend.watch.embedded(snap.path)
    if default is not None:
        text += f" Its {default.exact_match_text(backend.watch.view(snap.path).eval_points('exact_match'))}."
    return text


def expected(backend: Backend, path: str | None, question: str) -> str | None:
    """The embedded default's expected answer to `question` when the run trains it and the
    question is one of app.embedded.EXAMPLES."""
    try:
        root = backend.session.resolve(path)
    except SessionError:
        return None
    return expected_answer(question) if backend.watch.embedded(root) is not None else None


def _respond(backend: Backend, view: ChatView, text: str, chat: list, base_chat: list, path: str | None,
             max_new: int, temperature: float, top_p: float, top_k: Any, repetition: float,
             with_history: bool, compare: bool):
    """Stream the live model's answer into `view` (the Chat tab's and the Train tab's side panel
    alike; the side panel has no base column), then refresh the header (the step moved on)."""
    text = (text or "").strip()
    if not text:
        raise gr.Error("Type a message first.", print_exception=False)
    chat, base_chat = list(chat or []), list(base_chat or [])
    compare = compare and view.base is not None
    messages = sent_messages(chat, text, with_history)
    chat += [{"role": "user", "content": text}, {"role": "assistant", "content": "… waiting for the next step boundary"}]
    if compare:
        base_chat += [{"role": "user", "content": text}, {"role": "assistant", "content": "…"}]

    def shown() -> dict:
        return {view.live: chat, view.base: base_chat} if view.base is not None else {view.live: chat}

    yield {view.message: "", **shown()}
    params = dict(max_new_tokens=int(max_new), temperature=float(temperature), top_p=float(top_p),
                  top_k=int(top_k or 0), repetition_penalty=float(repetition))
    what = f"{_branch(backend, path)}live weights"
    want = expected(backend, path, text)
    if want is not None:
        what += f" · expected: {want}"
    try:
        for update in backend.session.chat(path, messages, compare_base=compare, **params):
            chat[-1] = {"role": "assistant", "content": tagged(update.text, update.step, what)}
            if compare:
                base_text = update.base or ("" if not update.done else update.note or "")
                base_chat[-1] = {"role": "assistant", "content": tagged(base_text, update.step, "adapter off")}
            yield shown()
    except SessionError as e:
        chat[-1] = {"role": "assistant", "content": f"⚠ {e}"}
        yield shown()
    yield {view.about: about_text(backend, path, view.note_default)}


def _branch(backend: Backend, path: str | None) -> str:
    """"branch NAME · " of the branch the live weights train on ("" before the run has branched)."""
    try:
        tree = BranchTree.load(backend.session.resolve(path))
    except (SessionError, OSError, ValueError):
        return ""
    return f"branch {tree.current} · " if len(tree.branches) > 1 else ""


def questions(chat: list | None) -> list[str]:
    """The questions of the chat that have an answer (the choices Teach offers), oldest first."""
    found = []
    messages = list(chat or [])
    for i, m in enumerate(messages[:-1]):
        answer = messages[i + 1]
        if m.get("role") == "user" and answer.get("role") == "assistant":
            text = text_of(m.get("content")).strip()
            if text and text not in found:
                found.append(text)
    return found


def teach_answer(backend: Backend, path: str | None, question: str | None, answer: str,
                 taught: gr.Markdown, wanted: gr.Textbox) -> dict:
    """Teach: the question (as the chat sent it, through the chat template) and the wanted answer
    go into the run's inbox and the next batches. A refusal (an empty or too long answer, a run
    that has ended) is shown, and the run goes on unchanged."""
    if not question:
        raise gr.Error("Ask something first, then pick the question whose answer to correct.", print_exception=False)
    if not (answer or "").strip():
        raise gr.Error("Write the answer you wanted first.", print_exception=False)
    try:
        try:
            result = backend.verbs(path).teach(None, answer, messages=[{"role": "user", "content": question}])
        except SessionError as e:
            if "chat template" not in str(e):
                raise
            result = backend.verbs(path).teach(question, answer)
    except SessionError as e:  # refused by the verb (the command's rules) or by the run
        raise gr.Error(str(e), print_exception=False) from None
    old = result.old
    text = (f"**Taught {result.id}** at step {result.step}: it is mixed into the next "
            "batches; the model is asked again after a few steps (the answers before and after are in the "
            "inbox, on the Train tab's data panel).")
    if old:
        text += f" Its answer before: *{old}*"
    return {taught: text, wanted: ""}


# -- comparing: another run, or a checkpoint of any branch, answering beside the live model ---------
# A live run answers with its own live weights; a checkpoint or a run that has ended answers from
# a chat-only copy (`Session.chat_with`: its own processes, ended with "End it").

def _checkpoints(backend: Backend, path: str | None) -> dict:
    """The Compare list: every branch's complete training checkpoints (newest first), then the
    other runs (live ones first; chat-only copies left out)."""
    try:
        root = backend.session.resolve(path)
    except SessionError:
        return gr.update(choices=[], value=None)
    choices = [(t.label, t.value) for t in checkpoint_targets(Path(root), BranchTree.load(root))]
    choices += other_runs(backend, root)
    return gr.update(choices=choices, value=choices[0][1] if choices else None)


def other_runs(backend: Backend, root: str) -> list[tuple[str, str]]:
    """(label, run folder) of every other run that can answer (Store.answering_runs): live ones
    with their live weights, ended ones through a chat-only copy of what they saved."""
    return [(f"run {i.name} ({i.state}, step {i.step}: its live weights)" if i.alive else
             f"run {i.name} ({i.state}: its last checkpoint or final model, in a chat-only copy)", i.path)
            for i in backend.store.answering_runs(root)]


def start_copy(backend: Backend, checkpoint: str | None, old: dict | None, copy: gr.State, other: gr.Chatbot,
               note: gr.Markdown) -> dict:
    """Compare with `checkpoint`: a checkpoint, or another run's folder (ending this page's
    earlier copy). A live run answers as it is; anything else through a chat-only copy of it."""
    if not checkpoint:
        raise SessionError("pick a checkpoint or a run first (the run has saved none yet?)")
    if old:
        _end(backend, old)
    where = Path(checkpoint)
    if (where / "events.jsonl").exists():  # a run folder
        run = backend.session.info(str(where), fresh=True)
        if run.alive:
            label = f"run {run.name}"
            return {copy: {"path": run.path, "label": label, "own": False},
                    other: gr.update(visible=True, value=[], label=f"{label} (its live weights)"),
                    note: f"Comparing with **{label}** as it trains: each question now goes to the live model, "
                          "then to that run. *End it* only stops comparing; the run goes on."}
        label = f"run {run.name} (as it ended)"
    else:
        branch = where.parent.parent.name if where.parent.parent.parent.name == "branches" else "main"
        label = f"checkpoint {where.name} of branch {branch}"
    info = backend.session.chat_with(checkpoint)
    return {copy: {"path": info.path, "label": label, "own": True},
            other: gr.update(visible=True, value=[], label=f"{label} (a chat-only copy)"),
            note: f"Starting a chat-only copy of **{label}** (run `{info.name}`): each question now goes to "
                  "the live model, then to the copy, which answers once its ranks are up."}


def stop_copy(backend: Backend, old: dict | None, copy: gr.State, other: gr.Chatbot, note: gr.Markdown) -> dict:
    """Stop comparing: this page's copy ends and its memory is freed (another live run goes on)."""
    said = "There was nothing to compare with."
    if old:
        _end(backend, old)
        said = f"The copy of {old['label']} has ended." if old.get("own", True) else f"No longer comparing with {old['label']}."
    return {copy: None, other: gr.update(visible=False, value=[]), note: said}


def live_label(backend: Backend, path: str | None) -> str:
    """The live column's label naming its run, for a side-by-side comparison."""
    try:
        return f"Run {Path(backend.session.resolve(path)).name}: the weights being trained"
    except SessionError:
        return LIVE


def _end(backend: Backend, copied: dict) -> None:
    if not copied.get("own", True):
        return  # another live run: not this page's to stop
    try:
        backend.session.stop(copied["path"], save=False, wait=True)
    except SessionError:
        pass  # it has ended already


def _respond_copy(backend: Backend, view: ChatView, text: str, other_chat: list, copied: dict,
                  max_new: int, temperature: float, top_p: float, top_k: Any, repetition: float,
                  with_history: bool, compare: bool):
    """The copy's answer to the same question, in its own column, labelled with its checkpoint."""
    text = (text or "").strip()
    if not text:
        return
    other_chat = list(other_chat or []) + [{"role": "user", "content": text},
                                           {"role": "assistant", "content": "… (the copy answers after the live model)"}]
    yield {view.other: other_chat}
    params = dict(max_new_tokens=int(max_new), temperature=float(temperature), top_p=float(top_p),
                  top_k=int(top_k or 0), repetition_penalty=float(repetition))
    want = expected(backend, copied["path"], text)
    what = copied["label"] + (f" · expected: {want}" if want is not None else "")
    try:
        for update in backend.session.chat(copied["path"], [{"role": "user", "content": text}], **params):
            other_chat[-1] = {"role": "assistant", "content": tagged(update.text, update.step, what)}
            yield {view.other: other_chat}
    except SessionError as e:
        other_chat[-1] = {"role": "assistant", "content": f"⚠ {e}"}
        yield {view.other: other_chat}
