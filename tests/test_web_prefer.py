"""Which answer is better, from the chat: the Chat tab's handlers (app.web.chat_prefer) ask a real
one-rank DPO run the same question twice (two samples differ), send "B is better" and "edit and
prefer" through the app's session as the contract's Teach with `rejected`, and show the entry's id
and the margin before; the notebook's Run.prefer and its chat box's Prefer send the same pair. The
refusals (no answers yet, nothing to compare with, an identical pair) reach the page as errors.
Then the same run in a browser (Debian's Chromium): its rewards plotted on the Train tab, "A is
better" clicked in the Chat tab, the pair listed in the Train tab's inbox and removed from it."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import gradio as gr
import pytest

from app.notebook.api import Run
from app.notebook.chat import ChatBox
from app.notebook.extras import DataControls
from app.session import SessionError
from app.web import build_app, chat, chat_prefer, launch_options
from app.web.backend import Backend
from contract.protocol.answers import TeachAnswer
from contract.protocol.base import ProtocolError
from contract.config.load import load_config
from contract.protocol.data_commands import Inbox, Teach
from contract.protocol.commands import Pause, Resume
from engine.data import default_task
from dist_utils import free_port
from web_page import SLOW, browser, open_tab, screenshot, set_number, state, wait_until  # noqa: F401 - browser: the fixture

SETTINGS = (8, 0.0, 1.0, 0, 1.0)  # max_new, temperature (greedy: the samples are warmed), top_p, top_k, repetition


def _view() -> chat_prefer.PairView:
    with gr.Blocks():
        return chat_prefer.PairView(gr.Textbox(), gr.Textbox(), gr.Textbox(), gr.Markdown(), gr.State(), gr.Button(),
                                    gr.Button())


def _inputs(tmp_path) -> None:
    from conftest import save_tiny_llama
    save_tiny_llama(tmp_path / "model")
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
    text = chat_prefer.said(_taught(id="t4", answer="qux", rejected="zorb", margin=-1.25, check_at_step=9))
    assert "**Preferred t4** at step 7" in text and "= -1.250" in text and "rejected answer" in text
    assert "step 9" in text and "*qux* over *zorb*" in text
    assert "*a\\*b \\<c\\>* over" in chat_prefer.said(_taught(id="t5", answer="a*b\n<c>", rejected="x"))  # as typed
    backend = Backend(tmp_path / "runs")
    try:
        with gr.Blocks():  # the fold is on the Chat tab
            chat.build(backend, gr.State(None))
    finally:
        backend.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One single-rank DPO run, paused once its control server answers, for every live test here
    (the handlers and the browser); yields (backend, run folder)."""
    tmp = tmp_path_factory.mktemp("prefer")
    _inputs(tmp)
    backend = Backend(tmp / "runs", run_env={"LIVETUNE_CACHE": str(tmp / "cache"), "LIVETUNE_HEARTBEAT_S": "0.5"})
    cfg = load_config(overrides=[
        f"output_dir={tmp / 'runs'}", "run_name=prefer-web", "nproc=1", "max_steps=1000", "batch_size=4",
        "precision=fp32", "objective=dpo", f"model.path={tmp / 'model'}",
        f"data.train={tmp / 'pairs.jsonl'}", "data.max_length=48", "eval.at_end=false",
        "eval.every_n_steps=0", "logging.tensorboard=false", "checkpoint.save_at_end=false",
        "teach.check_after=0"])
    path = backend.session.start(cfg).path
    try:
        backend.session.send(path, Pause(), connect_timeout=300.0)
        yield backend, path
    finally:
        backend.session.stop(path, save=False, wait=True)
        backend.close()


def _words(text: str) -> str:
    """Text as a page shows it: a sampled answer may hold any whitespace (a textbox turns \\r into \\n)."""
    return " ".join(text.split())


def _entry_id(said: str) -> str:
    found = re.match(r"\*\*Preferred (t\d+)\*\*", said)
    assert found, said
    return found.group(1)


@pytest.mark.slow  # the module's single-rank launch
def test_two_answers_then_this_one_is_better_and_edit_and_prefer_on_a_live_dpo_run(live):
    backend, path = live
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
    assert "Margin before" in said, said
    picked = _entry_id(said)
    edited = _entry_id(chat_prefer.prefer_edit(backend, view, path, pair, "cba")[view.result])
    run = Run(path, backend.session)
    taken = run.prefer("reverse: xy\n", "yx", "xy")
    assert isinstance(taken.margin, float)
    box = ChatBox(lambda: run)  # the notebook chat box: the box's answer over the model's last one
    box.transcript = [("user", "reverse: pq"), ("assistant", "pp")]
    box.prefer("qp").join(timeout=120)
    assert "over pp, margin before" in box.taught.value, box.taught.value
    boxed = re.search(r"preferred (t\d+)", box.taught.value).group(1)

    entries = {e["id"]: e for e in backend.session.send(path, Inbox()).entries}
    assert [(entries[i]["answer"], entries[i]["rejected"]) for i in (picked, edited, taken.id, boxed)] == [
        (pair["b"], pair["a"]), ("cba", pair["a"]), ("yx", "xy"), ("qp", "pp")]
    assert "reverse: abc" in entries[picked]["prompt"] and "<|assistant|>" in entries[picked]["prompt"]  # as the chat sent it
    assert len({picked, edited, taken.id, boxed}) == 4

    # the notebook's data fold lists the pairs (chosen and rejected) and Remove takes one out
    with ThreadPoolExecutor(1) as pool:
        controls = DataControls(lambda: run, lambda label, call: pool.submit(call, run), print)
        controls.refresh()
        assert dict((v, k) for k, v in controls.entry.options)[edited] == f"{edited}: cba over {pair['a']}"
        assert ">cba</td>" in controls.inbox.value and ">yx</td><td style='padding:0 8px'>xy</td>" in controls.inbox.value
        controls.entry.value = edited
        controls.forget().result(timeout=120)
    assert edited not in [v for _, v in controls.entry.options]
    assert next(e for e in run.entries() if e["id"] == edited)["removed"]


@pytest.mark.slow  # the module's single-rank launch
def test_long_answers_are_kept_within_what_a_pair_may_hold(live):
    """The chat asks for 64 new tokens where the run's data.max_length is 48: the page says before
    generating that the answers are kept shorter, and the pair chosen is trained, not refused."""
    backend, path = live
    view = _view()
    for _ in range(3):  # two samples that agree (or an empty one) are possible: ask again
        shown = {}
        for update in chat_prefer.two_answers(backend, view, path, "reverse: abcdef", chat_prefer.SAMPLE,
                                              None, 64, 1.0, 1.0, 0, 1.0):
            shown.update(update)
        pair = shown[view.pair]
        if chat_prefer.choosable(pair["a"], pair["b"]):
            break
    note = shown[view.result]
    assert note.startswith("Answers are kept to ") and "(not 64)" in note and "data.max_length=48" in note, note
    assert shown[view.a_better]["interactive"] is True, pair
    said = chat_prefer.pick(backend, view, path, pair, "a")[view.result]
    assert said.startswith("**Preferred t"), said  # the engine took the pair: it fits data.max_length
    with gr.Blocks():
        view.history = gr.Chatbot()
    recorded = chat_prefer.prefer_edit(backend, view, path, pair, "fedcba", [])[view.history]
    assert recorded[0] == {"role": "user", "content": "reverse: abcdef"} and recorded[1]["content"].startswith("fedcba")


@pytest.mark.slow  # a browser on the module's run
def test_the_ab_chat_in_a_browser_lands_the_pair_in_the_inbox_and_the_rewards_are_plotted(live, browser):
    """Chat tab: one question, two answers, "A is better"; the result names the entry, the Train
    tab's inbox lists the pair and Remove takes it out; the Train tab plots the run's rewards."""
    backend, path = live
    demo = build_app(backend)
    demo.queue(default_concurrency_limit=4)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, share=False,
                show_error=False, **launch_options())
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"http://127.0.0.1:{port}")  # a page opened on a live run shows that run
        wait_until(lambda: page.locator("#run-state").count() and state(page) == "paused", SLOW / 1000,
                   "the page on the paused run")
        # the rewards plot: drawn once the run logs its TRL metrics (a few steps of training)
        held = backend.session.info(path, fresh=True).step
        backend.session.send(path, Resume())
        wait_until(lambda: backend.session.info(path, fresh=True).step >= held + 3, 240, "three more steps")
        backend.session.send(path, Pause())
        rewards = page.locator("#train-plot-rewards")
        wait_until(lambda: rewards.is_visible() and rewards.locator("svg path").count() >= 6, 120,
                   "the rewards plot drawn")
        legend = rewards.locator(".lt-legend").inner_text()
        assert "chosen" in legend and "rejected" in legend, legend
        assert "reward accuracy" in rewards.locator("svg").text_content()
        screenshot(page, "rewards", "#train-plot-rewards")  # the docs' picture (LIVETUNE_SCREENSHOTS=1)

        open_tab(page, "Chat")
        page.locator("#chat-settings").click()
        max_new = page.locator("#chat-max-new input").first
        # short answers, so that the pair fits data.max_length (48) with the chat template; set
        # until the box holds it (a loaded page can still be applying its own updates)
        wait_until(lambda: set_number(page, "chat-max-new", "8") or max_new.input_value() == "8", 60,
                   "max_new_tokens set to 8")
        page.locator("#chat-prefer-fold").click()
        page.locator("#chat-prefer-question textarea").fill("reverse: abc")
        a, b = page.locator("#chat-prefer-a textarea"), page.locator("#chat-prefer-b textarea")
        for _ in range(3):  # two samples that agree (or an empty one) are possible: ask again
            page.locator("#chat-prefer-ask").click()
            wait_until(lambda: b.input_value() not in ("", "…"), 240, "the second answer")
            if a.input_value().strip() and b.input_value().strip() and a.input_value() != b.input_value():
                break
        chosen, rejected = a.input_value(), b.input_value()
        screenshot(page, "ab-chat", "#chat-prefer-fold")
        assert chosen != rejected and chosen.strip() and rejected.strip(), (chosen, rejected)
        page.locator("#chat-prefer-a-better").click()
        result = page.locator("#chat-prefer-result")
        wait_until(lambda: "Preferred t" in result.inner_text() or "teach:" in result.inner_text(), 240,
                   "the preference's answer")
        assert "Preferred t" in result.inner_text(), result.inner_text()  # not refused
        entry = re.search(r"Preferred (t\d+)", result.inner_text()).group(1)
        assert "Margin before" in result.inner_text()
        taken = next(e for e in backend.session.send(path, Inbox()).entries if e["id"] == entry)
        assert (_words(taken["answer"]), _words(taken["rejected"])) == (_words(chosen), _words(rejected))

        # the Train tab's inbox shows the pair; Remove from the inbox takes it out
        open_tab(page, "Train")
        page.locator("#data-fold").click()
        inbox = page.locator("#data-inbox")
        wait_until(lambda: entry in inbox.inner_text(), 60, "the pair in the inbox")
        listed = _words(inbox.inner_text())
        assert _words(chosen) in listed and _words(rejected) in listed, listed
        page.locator("#data-entry input").click()
        page.get_by_role("option", name=re.compile(rf"^{entry}: ")).click()
        page.locator("#data-forget").click()
        wait_until(lambda: f"{entry}** is no longer trained on" in page.locator("#data-result").inner_text()
                   or f"{entry} is no longer trained on" in page.locator("#data-result").inner_text(), 120,
                   "the entry removed")
        assert next(e for e in backend.session.send(path, Inbox()).entries if e["id"] == entry)["removed"]
    finally:
        page.close()
        demo.close()


def _taught(**fields) -> TeachAnswer:
    """The run's answer to a preference (contract.protocol.answers.TeachAnswer)."""
    return TeachAnswer(**{"step": 7, "prompt": "q", "old": "", "per_step": 1, "steps": 1, "check_at_step": None,
                          "applies_from_step": 8, "sources": [], **fields})
