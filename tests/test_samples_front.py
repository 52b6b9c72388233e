"""A GRPO run's samples and ratings in the front ends (app.samples, app.web.samples,
app.notebook.samples; docs/rewards.md "Samples and ratings"): the rows both front ends show, built
once from the `samples` event; and on a real running run (its own process, started by the web
app's backend), the web Train tab's fold and the notebook panel show the paused step's samples and
rate one each through the verbs, the terminal's `command` rates a third, the web fold forgets it;
the web Chat tab's fold and the notebook chat rate a chat answer each (the terminal's `rate_chat`
of an answer never given is refused, the web app's API `/rate_chat` rates a third through
gradio_client), and the next step trains the two kept samples' groups and
the two chat answers' groups as a `human` reward."""

from __future__ import annotations

import html
import json
import time
from pathlib import Path

import gradio as gr
import pytest

from app.samples import FIRST, LAST, NO_SAMPLES, rated_text, ratings, samples_table, sorted_rows
from app.series import RunHistory
from contract import inbox as inbox_file
from contract.events import SamplesEvent
from contract.protocol.rating_commands import RateAnswer


def _event(step: int = 3, count: int = 8) -> dict:
    rows = [{"number": i, "group": i // 2, "row": 7, "prompt": "2+2=", "completion": f"answer {i}",
             "rewards": {"exact": float(i % 2), "vowel": None if i == 1 else 0.123456},
             "total": None if i == 1 else float(i % 2) + 0.123456, "advantage": 0.5 - i % 2, "clipped": i == 2}
            for i in range(4)]
    return SamplesEvent(step=step, samples=rows, count=count, text_limit=300).record()


def test_the_rows_hold_each_reward_the_total_and_the_advantage():
    table = samples_table(_event())
    assert table.step == 3 and table.rewards == ["exact", "vowel"]
    assert table.columns == FIRST + ["exact", "vowel"] + LAST
    assert table.rows[0] == [0, 0, 7, "2+2=", "answer 0", 0.0, 0.1235, 0.1235, 0.5, False]
    assert table.rows[1][5:] == [1.0, None, None, -0.5, False]  # a function that did not score: empty
    assert "Step 3: the first 4 of 8 samples; texts cut at 300 characters" in table.caption
    by_total = sorted_rows(table, "total", descending=True)
    assert [r[0] for r in by_total] == [3, 0, 2, 1]  # None last
    assert [r[0] for r in sorted_rows(table, "advantage")] == [1, 3, 0, 2]
    none = samples_table(None)
    assert none.step is None and none.rows == [] and none.caption == NO_SAMPLES
    assert "cannot be read" in samples_table({"type": "samples", "step": 1, "samples": [{"number": 0}]}).caption
    # the history both front ends fold keeps the latest samples event
    history = RunHistory()
    history.update([_event(1), {"type": "train", "step": 1, "loss": 0.1}, _event(2)])
    assert samples_table(history.samples).step == 2


def test_the_ratings_are_listed_and_an_answer_is_said(tmp_path):
    path = inbox_file.inbox_path(tmp_path)
    group = {"prompt_ids": [1], "completion_ids": [[2], [3]], "rewards": {"exact": [0.0, 1.0]}, "rated": 1,
             "sample_step": 4, "sample": 5, "prompt": "2+2=", "completion": "4"}
    inbox_file.add_rating(path, "t1", 4, {**group, "score": 1.0})
    inbox_file.add_rating(path, "t2", 4, {**group, "score": -0.5})
    inbox_file.forget_entry(path, "t2", 5)
    given = ratings(tmp_path)
    assert [(g.id, g.forgotten) for g in given] == [("t1", False), ("t2", True)]
    assert given[0].label == 't1: step 4 #5 up · "4" (given at step 4)'
    assert given[1].label.startswith("t2: step 4 #5 -0.5") and given[1].label.endswith("forgotten at step 5")
    answer = RateAnswer(step=6, id="t3", sample_step=6, sample=2, group=0, score=-1.0, applies_from_step=7)
    assert rated_text(answer) == ("Rated sample #2 of step 6 down (t3): its group (0) is trained again at step 7 "
                                  "with a 'human' reward. Forget t3 to take it back.")


def test_the_web_fold_and_the_notebook_table_show_a_logged_step(tmp_path):
    from app.notebook.samples import SamplesControls
    from app.web import build_app
    from gradio_client import Client
    from app.web import build_app, chat_rate, samples as web_samples
    from app.web.chat_turns import tagged
    from app.web.backend import Backend
    from contract.run_folder import EventLog, RunFolder

    folder = RunFolder(tmp_path / "runs" / "grpo").create()
    folder.config.write_text("objective: grpo\n")
    log = EventLog(folder.events)
    for event in ({"type": "state", "state": "running", "time": 1.0}, _event(1),
                  {"type": "state", "state": "finished", "step": 1, "time": 2.0}):
        log.emit(dict(event))
    log.close()
    backend = Backend(tmp_path / "runs")
    try:
        ids = {getattr(block, "elem_id", None) for block in build_app(backend).blocks.values()}
        assert {"samples-table", "samples-rate", "samples-forget", "samples-score"} <= ids  # on the Train tab
        with gr.Blocks():
            panel = web_samples.build(backend, gr.State(None))
        shown = web_samples.show(backend, panel, str(folder.root))
        frame = shown[panel.table]
        assert list(frame.columns) == FIRST + ["exact", "vowel"] + LAST and len(frame) == 4
        assert frame.iloc[1]["vowel"] is None and frame.iloc[3]["completion"] == "answer 3"
        assert shown[panel.step] == 1 and shown[panel.caption].startswith("Step 1:")
        assert shown[panel.rate]["interactive"] is False  # a finished run takes no rating
        picked = gr.SelectData(None, {"index": [2, 4], "value": "answer 3", "row_value": [3, 1, 7, "2+2=", "answer 3"]})
        assert web_samples.pick(picked) == 3
        assert "pick a sample first" in web_samples.do_rate(backend, panel, str(folder.root), 1, None, "up")[panel.result]
        refused = web_samples.do_rate(backend, panel, str(folder.root), 1, 0, "sideways")[panel.result]
        assert refused.startswith("**Not rated**: ") and "'score'" in refused, refused
    finally:
        backend.close()

    history = RunHistory()
    history.update([_event(1)])
    controls = SamplesControls(lambda: None, lambda label, call: None, lambda text: None, lambda: history)
    controls.show(history)
    assert "answer 3" in controls.table.value and "Step 1:" in controls.caption.value
    assert list(controls.sort.options) == FIRST + ["exact", "vowel"] + LAST
    controls.sort.value, controls.descending.value = "total", True
    table = controls.table.value
    assert table.index("answer 3") < table.index("answer 0") < table.index("answer 2") < table.index("answer 1")


# -- a real run -----------------------------------------------------------------------------------
def _wait(what: str, check, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    pytest.fail(f"no {what} within {timeout} s")


@pytest.mark.slow  # a GRPO run of a tiny Llama in its own process (~30 s)
def test_a_running_run_is_rated_from_the_web_the_notebook_and_the_terminal(tmp_path, monkeypatch):
    from conftest import save_tiny_llama
    from web_page import end_runs
    from app.cli_command import command
    from app.notebook.panel import RunPanel
    from gradio_client import Client
    from app.web import build_app, chat_rate, samples as web_samples
    from app.web.chat_turns import tagged
    from app.web.backend import Backend
    from contract.config.load import load_config
    from contract.run_folder import read_events
    from engine.data import default_task

    runs = tmp_path / "runs"
    monkeypatch.setenv("LIVETUNE_OUTPUT_DIR", str(runs))
    monkeypatch.setenv("LIVETUNE_HEARTBEAT_S", "0.5")
    save_tiny_llama(tmp_path / "model")
    rows = [{"prompt": r["input"], "answer": r["output"]} for r in default_task.make_examples(32, 5)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(overrides=[
        "run_name=rated", "max_steps=100000", "batch_size=2", "precision=fp32", "train.seed=3",
        f"model.path={tmp_path / 'model'}", f"data.train={tmp_path / 'prompts.jsonl'}", "data.max_length=40",
        "eval.every_n_steps=0", "eval.at_end=false", "logging.tensorboard=false", "checkpoint.save_at_end=false",
        "objective=grpo", "grpo.num_generations=4", "grpo.max_completion_length=4",
        "grpo.rewards=[{kind: exact_match, column: answer}]"])
    backend, panel, demo = Backend(runs), None, None
    try:
        path = backend.session.start(cfg, output_dir=runs).path
        events = Path(path) / "events.jsonl"
        _wait("samples", lambda: any(e["type"] == "samples" for e in read_events(events)))
        paused = backend.verbs(path).pause().step  # the latest samples stay the ones a rating names
        with gr.Blocks():
            fold = web_samples.build(backend, gr.State(None))
        shown = web_samples.show(backend, fold, path)
        assert shown[fold.step] == paused and len(shown[fold.table]) == 8
        assert shown[fold.rate]["interactive"] is True
        web = web_samples.do_rate(backend, fold, path, paused, 1, "up")
        assert web[fold.result].startswith(f"Rated sample #1 of step {paused} up (t1)"), web[fold.result]
        assert f"at step {paused + 1}" in web[fold.result]
        refused = web_samples.do_rate(backend, fold, path, paused, 99, "up")[fold.result]
        assert f"step {paused} has samples 0 to 7, not 99" in refused, refused

        panel = RunPanel(output_dir=runs)  # the notebook panel reattaches to the live run
        _wait("the notebook's table", lambda: panel.samples.shown.step == paused)
        assert panel.samples.table.value.count("<tr>") == 9  # the header and the step's 8 samples
        panel.samples.sample.value, panel.samples.score.value = 5, "down"
        answer = panel.samples.rate().result(timeout=120)
        assert (answer.id, answer.sample, answer.score, answer.group) == ("t2", 5, -1.0, 1)
        # the future's callbacks (which write the answer under the table) run after its waiters wake
        _wait("the answer under the table", lambda: panel.samples.result.value.startswith(
            f"Rated sample #5 of step {paused} down (t2)"))

        said_words: list[str] = []
        code = command([path, "rate", f"step={paused}", "sample=6", "score=0.5"],
                       lambda text, *style: said_words.append(text))
        assert code == 0 and json.loads(said_words[-1])["id"] == "t3", said_words
        shown = web_samples.show(backend, fold, path)
        assert [c[1] for c in shown[fold.rating]["choices"]] == ["t1", "t2", "t3"]
        forgot = web_samples.do_forget(backend, fold, path, "t3")[fold.result]
        assert forgot.startswith("Forgotten t3"), forgot
        stored = {r["id"]: r for r in inbox_file.read_ratings(Path(path) / "inbox.jsonl")}
        assert [stored[i]["score"] for i in ("t1", "t2", "t3")] == [1.0, -1.0, 0.5]
        assert stored["t3"]["forgotten_at"] == paused and stored["t1"]["forgotten_at"] is None

        # a chat answer rated: up from the web Chat tab's fold, down from the notebook chat
        with gr.Blocks():
            rate_fold = chat_rate.build(backend, gr.State(None), gr.Chatbot(), gr.Checkbox(False))
        assert chat_rate.shown(backend, path, rate_fold)[rate_fold]["visible"] is True
        asked = [{"role": "user", "content": "reverse: abc"}]
        said = list(backend.session.chat(path, asked, max_new_tokens=6, temperature=1.0))[-1]
        shown_chat = [*asked, {"role": "assistant", "content": tagged(said.text, said.step, "live weights")}]
        web_chat = chat_rate.rate_last(backend, path, shown_chat, False, "up")
        assert web_chat.startswith(f"Rated the chat's answer of step {paused} up (t4): at step {paused + 1} it "
                                   "trains with 3 fresh answers"), web_chat
        panel.chat.send("reverse: hello").join(timeout=120)
        panel.chat.rate("down").join(timeout=120)
        assert html.unescape(panel.chat.rated.value).startswith(
            f"<span style='color:#333'>Rated the chat's answer of step {paused} down (t5)"), panel.chat.rated.value
        code = command([path, "rate_chat", "prompt=reverse: abc", "answer=never said", "score=up"],
                       lambda text, *style: said_words.append(text))
        assert code == 2 and "gave no such answer to that prompt" in said_words[-1], said_words
        # the web app's API (gradio_client): a raw prompt's answer rated down
        demo = build_app(backend)
        demo.queue(default_concurrency_limit=4)
        _, url, _ = demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True,
                                share=False, show_error=False)
        answer = backend.verbs(path).generate("reverse: xyz\n", max_new_tokens=6, temperature=1.0).wait()
        api = Client(url, verbose=False).predict(prompt="reverse: xyz\n", answer=answer.text, score="down",
                                                  step=answer.step, run="rated", api_name="/rate_chat")
        assert (api["id"], api["score"], api["applies_from_step"]) == ("t6", -1.0, paused + 1), api

        backend.verbs(path).resume()
        trained = _wait("the rated step", lambda: next((e for e in read_events(events)
                                                        if e["type"] == "train" and e["step"] == paused + 1), None))
        # the samples' up and down, the chat's up, down, down (each with 3 fresh answers' 0); not the forgotten 0.5
        assert trained["rewards/human/mean"] == pytest.approx(-1 / 14)
        assert trained["rewards/human/std"] == pytest.approx(((5 - 14 / 14 ** 2) / 13) ** 0.5)
        backend.session.stop(path, save=False, wait=True)
    finally:
        if demo is not None:
            demo.close()
        if panel is not None:
            panel.close()
        backend.close()
        end_runs(runs)
