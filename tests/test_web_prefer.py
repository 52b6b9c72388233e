"""Which answer is better, from the chat, without a browser: the Chat tab's handlers (app.web.
chat_prefer) ask a real one-rank DPO run the same question twice (two samples differ), send "B is
better" and "edit and prefer" through the app's session as the contract's Teach with `rejected`,
and show the entry's id and the margin before; the notebook's Run.prefer and its chat box's Prefer send the same pair. The
refusals (no answers yet, nothing to compare with, an identical pair) reach the page as errors."""

from __future__ import annotations

import json

import gradio as gr
import pytest

from app.notebook.api import Run
from app.notebook.chat import ChatBox
from app.session import SessionError
from app.web import chat, chat_prefer
from app.web.backend import Backend
from contract.protocol.base import ProtocolError
from contract.config.load import load_config
from contract.protocol.data_commands import Inbox, Teach
from contract.protocol.commands import Pause
from engine import default_task

SETTINGS = (8, 0.0, 1.0, 0, 1.0)  # max_new, temperature (greedy: the samples are warmed), top_p, top_k, repetition


def _view() -> chat_prefer.PairView:
    with gr.Blocks():
        return chat_prefer.PairView(gr.Textbox(), gr.Textbox(), gr.Textbox(), gr.Markdown(), gr.State())


def _inputs(tmp_path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from conftest import make_tiny_tokenizer
    tok = make_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [default_task.preference_row(r) for r in default_task.make_examples(64, 5)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_pair_and_the_refusals_before_any_run(tmp_path):
    view = _view()
    command = chat_prefer.pair_command("capital: zorb", "qux", "zorb")
    assert isinstance(command, Teach) and command.rejected == "zorb" and command.answer == "qux"
    assert command.messages == [{"role": "user", "content": "capital: zorb"}]
    assert chat_prefer.pair_command("q", "a", "b", chat=False).prompt == "q"
    with pytest.raises(ProtocolError, match="same answer"):
        chat_prefer.prefer_edit(None, view, None, {"question": "q", "a": "x", "b": "y"}, "x")  # type: ignore[arg-type]
    with pytest.raises(SessionError, match="press Two answers first"):
        chat_prefer.pick(None, view, None, None, "a")  # type: ignore[arg-type]
    with pytest.raises(SessionError, match="nothing to compare with"):
        list(chat_prefer.two_answers(None, view, None, "q", chat_prefer.COMPARED, None, *SETTINGS))  # type: ignore[arg-type]
    text = chat_prefer.said({"id": "t4", "step": 7, "answer": "qux", "rejected": "zorb", "margin": -1.25,
                             "check_at_step": 9})
    assert "**Preferred t4** at step 7" in text and "= -1.250" in text and "rejected answer" in text
    assert "step 9" in text and "*qux* over *zorb*" in text
    assert "*a\\*b \\<c\\>* over" in chat_prefer.said({"id": "t5", "answer": "a*b\n<c>", "rejected": "x"})  # as typed
    backend = Backend(tmp_path / "runs")
    try:
        with gr.Blocks():  # the fold is on the Chat tab
            chat.build(backend, gr.State(None))
    finally:
        backend.close()


@pytest.mark.slow  # one single-rank launch
def test_two_answers_then_this_one_is_better_and_edit_and_prefer_on_a_live_dpo_run(tmp_path):
    _inputs(tmp_path)
    backend = Backend(tmp_path / "runs", run_env={"LIVETUNE_CACHE": str(tmp_path / "cache"),
                                                   "LIVETUNE_HEARTBEAT_S": "0.5"})
    cfg = load_config(overrides=[
        f"output_dir={tmp_path / 'runs'}", "run_name=prefer-web", "nproc=1", "max_steps=1000", "batch_size=4",
        "precision=fp32", "objective=dpo", f"model.path={tmp_path / 'model'}",
        f"data.train={tmp_path / 'pairs.jsonl'}", "data.max_length=48", "eval.at_end=false",
        "eval.every_n_steps=0", "logging.tensorboard=false", "checkpoint.save_at_end=false",
        "teach.check_after=0"])
    path = backend.session.start(cfg).path
    try:
        backend.session.send(path, Pause(), connect_timeout=300.0)
        view = _view()
        for _ in range(3):  # a sample that is empty, or two that agree, is possible: ask again
            shown = {}
            for update in chat_prefer.two_answers(backend, view, path, "reverse: abc", chat_prefer.SAMPLE,
                                                  None, *SETTINGS):
                shown.update(update)
            pair = shown[view.pair]
            if pair["a"].strip() and pair["b"].strip() and pair["a"] != pair["b"]:
                break
        assert pair["question"] == "reverse: abc" and pair["a"] != pair["b"], pair
        assert shown[view.edited] == pair["a"]  # the edit starts from A

        # the Compare column's run answers B (here the same run, standing in for another live one)
        compared = {}
        for update in chat_prefer.two_answers(backend, view, path, "reverse: abc", chat_prefer.COMPARED,
                                              {"path": path, "label": "run other"}, *SETTINGS):
            compared.update(update)
        assert compared[view.second]["label"] == "B: run other" and compared[view.pair]["question"] == "reverse: abc"

        said = chat_prefer.pick(backend, view, path, pair, "b")[view.result]
        assert said.startswith("**Preferred t1**") and "Margin before" in said, said
        said = chat_prefer.prefer_edit(backend, view, path, pair, "cba")[view.result]
        assert said.startswith("**Preferred t2**"), said
        run = Run(path, backend.session)
        taken = run.prefer("reverse: xy\n", "yx", "xy")
        assert taken["id"] == "t3" and isinstance(taken["margin"], float)
        box = ChatBox(lambda: run)  # the notebook chat box: the box's answer over the model's last one
        box.transcript = [("user", "reverse: pq"), ("assistant", "pp")]
        box.prefer("qp").join(timeout=120)
        assert "preferred t4" in box.taught.value and "over pp, margin before" in box.taught.value, box.taught.value

        entries = backend.session.send(path, Inbox())["entries"]
        assert [(e["answer"], e["rejected"]) for e in entries] == [
            (pair["b"], pair["a"]), ("cba", pair["a"]), ("yx", "xy"), ("qp", "pp")]
        assert "reverse: abc" in entries[0]["prompt"] and "<|assistant|>" in entries[0]["prompt"]  # as the chat sent it
    finally:
        backend.session.stop(path, save=False, wait=True)
        backend.close()
