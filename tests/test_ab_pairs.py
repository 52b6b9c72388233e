"""A/B that holds up, without a run (the handlers of app.web.chat_prefer and app.web.data, and
app.embedded's note): the choice buttons stay off until two different, non-empty answers exist
and a pair that is not one is refused; the answers are kept to what a pair may hold (the page
says so before generating); a viewer's press is refused naming prefer; the inbox table names
a pair's chosen and rejected answers, shows the prompt without its special tokens, and calls a
pair learned when the model prefers its chosen answer at the check (the margin's sign); the chat
note of a preference or GRPO run says what that objective does instead of promising the SFT
task's answers. The live half (a real DPO run answering within data.max_length) is
tests/test_web_prefer.py's."""

from __future__ import annotations

import gradio as gr
import pytest

from app.embedded import early_note, embedded_default
from app.session import SessionError
from app.sources import data_view
from app.web import chat, chat_prefer, chat_side
from app.web import data as web_data
from app.web.backend import Backend
from app.web.widgets import TABLE_CLASS
from contract.inbox import add_entry, inbox_path
from contract.protocol.answers import TeachAnswer
from contract.protocol.roles import Role
from test_web_split_chat import _run  # a run folder with a config and an event log

SETTINGS = (64, 1.0, 1.0, 0, 1.0)  # the chat's max_new, temperature, top_p, top_k, repetition


def _view() -> chat_prefer.PairView:
    with gr.Blocks():
        return chat_prefer.PairView(gr.Textbox(), gr.Textbox(), gr.Textbox(), gr.Markdown(), gr.State(),
                                    gr.Button(), gr.Button(), gr.Chatbot())


def test_the_choice_needs_two_different_answers_and_fits_the_pair(tmp_path):
    view = _view()
    assert chat_prefer.choosable("cba", "abc") and not chat_prefer.choosable("cba", "cba")
    assert not chat_prefer.choosable("", "abc") and not chat_prefer.choosable("cba", "  \n")
    for shown in ({"question": "q", "a": "x", "b": ""}, {"question": "q", "a": "x", "b": "x"}):
        with pytest.raises(SessionError, match="the same, or one is empty"):
            chat_prefer.pick(None, view, None, shown, "a")  # type: ignore[arg-type]

    # the room an answer has: data.max_length less the question and the end token
    budget = chat_prefer.Budget(max_length=32, prompt_tokens=11)
    assert budget.answer_tokens == 20
    assert budget.note(64).startswith("Answers are kept to 20 tokens (not 64)") and "data.max_length=32" in budget.note(64)
    assert budget.note(8) == ""

    # the pair taken is recorded in the chat history: the question, the chosen answer, what it beat
    taken = TeachAnswer(step=7, id="t4", prompt="<s>q", answer="cba", rejected="a*c", old="", per_step=1, steps=1,
                        check_at_step=None, applies_from_step=8, sources=[], margin=-0.5)
    page = chat_prefer.preferred(view, [{"role": "user", "content": "hi"}], "reverse: abc", taken)
    assert "**Preferred t4** at step 7" in page[view.result]
    assert page[view.history][0] == {"role": "user", "content": "hi"}
    assert page[view.history][1:] == [{"role": "user", "content": "reverse: abc"},
                                      {"role": "assistant", "content": "cba\n\n*preferred (t4, step 7) over:* a\\*c"}]

    backend = Backend(tmp_path / "runs")
    try:
        steps = chat_prefer.two_answers(backend, view, None, "reverse: abc", chat_prefer.SAMPLE, None, *SETTINGS)
        first = next(steps)  # the buttons go off before anything is asked
        assert first[view.a_better]["interactive"] is False and first[view.b_better]["interactive"] is False
        with pytest.raises(SessionError, match="no run yet"):  # the room is asked of the run before generating
            next(steps)
        with gr.Blocks() as page:  # the buttons start off, in the Chat tab and beside the plots
            chat.build(backend, gr.State(None))
            chat_side.build(backend, gr.State(None))
        ids = {b.elem_id: b for b in page.blocks.values() if getattr(b, "elem_id", None)}
        for prefix in ("chat-prefer", "side-prefer"):
            assert ids[f"{prefix}-a-better"].interactive is False and ids[f"{prefix}-b-better"].interactive is False
            assert ids[f"{prefix}-ask"].value == "Two answers"
        assert ids["side-prefer-second"].visible is False  # beside the plots, B is another sample
        # a viewer's press names what was pressed, before anything is sent
        backend.session.holder, backend.session.role_of = "login", lambda: Role.VIEWER
        with pytest.raises(SessionError, match=r"refused: prefer \(choosing the better answer\) needs the operator "
                                               r"role; this login is a viewer's"):
            chat_prefer.prefer(backend, None, "reverse: abc", "cba", "abc")
    finally:
        backend.close()


def test_the_inbox_table_names_chosen_and_rejected_and_learned_is_the_margins_sign(tmp_path):
    folder = _run(tmp_path / "runs", "dpo", {"preference": {"objective": "dpo"}}, [
        {"type": "state", "state": "starting"},
        {"type": "teach", "step": 2, "id": "t1", "answer": "cba", "rejected": "abc", "margin": -0.5},
        {"type": "teach", "step": 2, "id": "t2", "answer": "ba", "rejected": "ab", "margin": 0.25},
        # t1: the greedy answer is not yet the chosen one, but the model prefers it now
        {"type": "teach_check", "step": 4, "id": "t1", "old": "", "new": "c", "learned": False,
         "margin_before": -0.5, "margin_after": 0.75, "prefers": "chosen"},
        {"type": "teach_check", "step": 4, "id": "t2", "old": "", "new": "ba", "learned": True,
         "margin_before": 0.25, "margin_after": -0.125, "prefers": "rejected"},
        {"type": "state", "state": "finished", "step": 5}])
    inbox = inbox_path(folder.root)
    add_entry(inbox, "t1", "<s><|user|>reverse: abc<|assistant|>", "cba", 2, rejected="abc")
    add_entry(inbox, "t2", "<s>reverse: ab\n", "ba", 2, rejected="ab")
    add_entry(inbox, "t3", "<s>sort: ba\n", "ab", 3)
    entries = {e["id"]: e for e in data_view(folder).inbox}
    assert entries["t1"]["learned"] is True and entries["t2"]["learned"] is False
    assert entries["t3"]["learned"] is None  # not checked yet

    backend = Backend(tmp_path / "runs")
    try:
        with gr.Blocks():
            panel = web_data.build(backend, gr.State(None))
        assert TABLE_CLASS in panel.inbox.elem_classes  # headers never break inside a word
        assert "margin log p(chosen) − log p(rejected) is above 0" in panel.inbox.label
        frame = web_data.show(backend, panel, str(folder.root))[panel.inbox].set_index("id")
        assert list(frame.columns)[:3] == ["prompt", "answer (chosen)", "rejected"]
        assert frame.loc["t1", "prompt"] == "reverse: abc" and frame.loc["t2", "prompt"] == "reverse: ab"
        assert (frame.loc["t1", "answer (chosen)"], frame.loc["t1", "rejected"]) == ("cba", "abc")
        assert frame.loc["t1", "learned"] == "yes" and frame.loc["t2", "learned"] == "not yet"
        assert frame.loc["t3", "learned"] == "" and frame.loc["t3", "rejected"] == ""
    finally:
        backend.close()


def test_the_chat_note_says_what_the_objective_does(tmp_path):
    assert "olleh" in early_note() and "olleh" in early_note("sft")
    dpo = early_note("dpo")
    assert "olleh" not in dpo and "rank the right answer above the wrong one" in dpo and "exact match stays" in dpo
    assert "olleh" not in early_note("kto") and "desirable" in early_note("kto")
    assert "olleh" in early_note("orpo") and "likelihood term" in early_note("orpo")  # ORPO writes answers too
    assert "olleh" not in early_note("grpo") and "mean reward" in early_note("grpo")

    steps = [{"type": "state", "state": "starting"}, {"type": "setup", "total_steps": 40},
             {"type": "train", "step": 1, "loss": 0.69}]
    dpo_run = _run(tmp_path / "runs", "dpo", {"preference": {"objective": "dpo"}}, steps)
    sft_run = _run(tmp_path / "runs", "sft", {}, steps)
    assert embedded_default(dpo_run.root).objective == "dpo"
    backend = Backend(tmp_path / "runs")
    try:
        said = chat.about_text(backend, str(dpo_run.root))
        assert "with dpo" in said and "reward accuracy and margin" in said and "olleh" not in said, said
        assert "olleh" in chat.about_text(backend, str(sft_run.root))
    finally:
        backend.close()
