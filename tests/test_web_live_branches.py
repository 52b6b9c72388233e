"""The web app's branch and data controls on one real run of the embedded default (one rank),
through the handlers the buttons call (each returns {component: value}): Snapshot now, Branch
from a listed checkpoint with another learning rate, Rewind to the snapshot, the branch tree and
the overlaid plots (the abandoned steps apart); the data panel's weight change, an added source,
a refused bad file; Teach from a chat answer, the inbox listing it, and Remove from the inbox."""

from __future__ import annotations

import json
import time

import gradio as gr
import pandas as pd
import pytest

from app.form import config_from_text
from app.session import SessionError
from app.web import branches as web_branches
from app.web import chat as web_chat
from app.web import data as web_data
from app.web.backend import Backend
from app.web.plots import live_plot
from contract.protocol.commands import Pause, Resume, Save
from web_page import end_runs
from test_web_backend import QUIET, wait_state, wait_step


def _section() -> web_branches.BranchesSection:
    return web_branches.BranchesSection(
        gr.HTML(), gr.Dropdown(), gr.Button(), gr.Textbox(), gr.Textbox(), gr.Button(), gr.Textbox(), gr.Button(),
        gr.Markdown(), {p: live_plot(p, f"t-{p}") for p in web_branches.PLOTS})


def _panel() -> web_data.DataPanel:
    return web_data.DataPanel(gr.Dataframe(), gr.Dropdown(), gr.Textbox(), gr.Button(), gr.Button(), gr.Textbox(),
                              gr.Dropdown(), gr.Textbox(), gr.Textbox(), gr.Button(), live_plot("seen", "t-seen"),
                              gr.Dataframe(), gr.Dropdown(), gr.Button(), gr.Button(), gr.Markdown())


@pytest.mark.slow
def test_branch_rewind_snapshot_data_and_teach_from_the_web_handlers(tmp_path):
    runs = tmp_path / "runs"
    backend = Backend(runs)
    with gr.Blocks():
        section, panel = _section(), _panel()
        taught, wanted = gr.Markdown(), gr.Textbox()
        copy, other, note = gr.State(None), gr.Chatbot(), gr.Markdown()
        chat_view = web_chat.ChatView(gr.Textbox(), gr.Chatbot(), gr.Chatbot(), gr.Markdown(), other)
    try:
        cfg = config_from_text(QUIET + "train: {max_steps: 3000}\ncheckpoint: {save_at_end: false}\n"
                               "logging: {run_name: live, tensorboard: false}", output_dir=str(runs))
        path = backend.session.start(cfg).path
        wait_step(backend, path, 2)
        backend.session.send(path, Pause())
        saved = backend.session.send(path, Save())
        # a chat-only copy of that checkpoint, to answer beside the live model (it starts meanwhile)
        started = web_chat.start_copy(backend, saved.checkpoint, None, copy, other, note)
        copied = started[copy]
        assert copied["label"] == f"checkpoint step-{saved.step} of branch main"
        assert started[other]["visible"] and "Starting a chat-only copy" in started[note]
        shown = web_branches.show(backend, section, path)
        choices = shown[section.target]["choices"]
        assert (f"step-{saved.step} (main)", saved.checkpoint) in choices
        assert all(shown[b]["interactive"] for b in (section.rewind, section.branch, section.snapshot))

        snap = web_branches.do_snapshot(backend, section, path, "before")
        assert "**Snapshot before** kept at step" in snap[section.result]
        assert ("snapshot before (main, step %d)" % saved.step, "snapshot:before") in snap[section.target]["choices"]

        # the data panel: the embedded task is the one source; a weight change and a new source
        extra = tmp_path / "extra.jsonl"
        extra.write_text("".join(json.dumps({"input": f"upper: {w}", "output": w.upper()}) + "\n"
                                 for w in ("abc", "zorb", "qux", "hello")))
        look = web_data.show(backend, panel, path)
        assert list(look[panel.sources]["source"]) == ["train"] and look[panel.add]["interactive"]
        added = web_data.do_add(backend, panel, path, str(extra), "input_output", "0.5", "extra")
        assert "**Added extra** (weight 0.5)" in added[panel.result]
        assert set(added[panel.sources]["source"]) == {"train", "extra"}
        weighted = web_data.do_set_weight(backend, panel, path, "extra", "2")
        assert weighted[panel.sources].set_index("source").loc["extra", "weight"] == 2
        bad = tmp_path / "bad.jsonl"
        bad.write_text("not json\n")
        with pytest.raises(SessionError, match="bad.jsonl"):
            web_data.do_add(backend, panel, path, str(bad), "auto", "1", "")
        with pytest.raises(ValueError, match="weight must be a number >= 0"):
            web_data.do_set_weight(backend, panel, path, "extra", "-1")

        # Teach from a chat answer: into the inbox, listed, then removed
        with pytest.raises(gr.Error, match="Write the answer you wanted"):
            web_chat.teach_answer(backend, path, "capital: zorb", " ", taught, wanted)
        out = web_chat.teach_answer(backend, path, "capital: zorb", "qux", taught, wanted)
        assert out[taught].startswith("**Taught t1** at step") and out[wanted] == ""
        inbox = web_data.show(backend, panel, path)
        assert list(inbox[panel.inbox]["answer (chosen)"]) == ["qux"] and inbox[panel.entry]["value"] == "t1"
        forgot = web_data.do_forget(backend, panel, path, "t1")
        assert list(forgot[panel.inbox]["removed"]) == ["yes"] and forgot[panel.entry]["choices"] == []

        # branch from the checkpoint with another lr, train on, then rewind to the snapshot
        branched = web_branches.do_branch(backend, section, path, saved.checkpoint, "slow", "0.0001")
        assert "**Branch slow** goes on from step %d" % saved.step in branched[section.result]
        assert "◀ training here" in branched[section.tree] and "slow" in branched[section.tree]
        backend.session.send(path, Resume())
        wait_step(backend, path, saved.step + 3)
        backend.session.send(path, Pause())
        rewound = web_branches.do_rewind(backend, section, path, "snapshot:before")
        assert f"**Rewound** to step {saved.step}" in rewound[section.result]
        assert "are abandoned" in rewound[section.result]
        series = json.loads(rewound[section.plots["branch_loss"]])["series"]
        assert "loss · main" in series and "loss · slow" in series
        assert any("(abandoned" in name for name in series), series.keys()
        with pytest.raises(SessionError, match="nope"):
            web_branches.do_rewind(backend, section, path, "snapshot:nope")
        # the checkpoint's copy answers in its own column, labelled with where it came from
        *_, last = web_chat._respond_copy(backend, chat_view, "reverse: abc", [], copied, 8, 0.0, 1.0, 0, 1.0,
                                          False, False)
        answer = last[other][-1]["content"]
        assert answer.endswith(f"<sub>step {saved.step} · checkpoint step-{saved.step} of branch main</sub>"), answer
        ended = web_chat.stop_copy(backend, copied, copy, other, note)
        assert ended[copy] is None and not backend.session.info(copied["path"], fresh=True).alive
        # the snapshot was taken before "extra" was added: the rewind took the sources back too
        assert list(web_data.show(backend, panel, path)[panel.sources]["source"]) == ["train"]
        seen = json.loads(web_data.show(backend, panel, path)[panel.seen])["series"]
        assert seen["train"]["points"][-1][1] > 0  # samples drawn from the embedded task, plotted

        # the notebook panel's same controls, on the same run
        from app.notebook.panel import RunPanel
        nb = RunPanel(output_dir=runs)
        try:
            assert nb.run is not None and "slow" in nb.branches.tree.value and "◀ training here" in nb.branches.tree.value
            assert "snapshot:before" in [v for _, v in nb.branches.target.options]
            deadline = time.monotonic() + 60  # the panel's watcher enables what the state allows
            while nb.branches.rewind_button.disabled and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not nb.branches.rewind_button.disabled and not nb.data.add_button.disabled
            nb.branches.snapshot().result(timeout=120)
            nb.branches.refresh()
            assert len([v for _, v in nb.branches.target.options if v.startswith("snapshot:")]) == 2
            nb.data.source.value, nb.data.weight.value = "train", "2"
            nb.data.set_weight().result(timeout=120)
            nb.data.refresh()
            assert "<td style='padding:0 8px'>train</td><td style='padding:0 8px'>2.0</td>" in nb.data.sources.value
            nb.chat.transcript = [("user", "capital: zorb"), ("assistant", "?")]
            nb.chat.teach("qux").join(timeout=120)
            assert "taught t2" in nb.chat.taught.value, nb.chat.taught.value
            nb.data.refresh()
            assert [label for label, _ in nb.data.entry.options] == ["t2: qux"]  # t1 was removed
        finally:
            nb.close()
    finally:
        backend.close()
        end_runs(runs)
