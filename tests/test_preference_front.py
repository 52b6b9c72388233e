"""A preference run in the front ends, without a run: the reward plots (web feed and notebook PNG)
from an event log holding TRL's metric names, and none for an SFT run; the data preview's pairs
side by side in the web app's note, the notebook and the terminal, read by the engine's own
preview process; the inbox listing a preference's rejected answer and its margins (web and
notebook)."""

from __future__ import annotations

import json
import struct

import gradio as gr
import pytest
from rich.console import Console

from app.cli_preview import preview
from app.data_preview import data_preview, pairs_html, pairs_markdown
from app.notebook.api import Run
from app.notebook.extras import DataControls
from app.notebook.plots import render_png
from app.notebook.preview import preview_data
from app.series import RunHistory, preference_series
from app.sources import data_view, margin_text
from app.web import data as web_data
from app.web.backend import Backend
from app.web.backend.preview import describe_data
from app.web.backend.views import RunView
from app.web.feed import feed
from app.web.plots import SPECS, live_plot
from contract.inbox import add_entry, forget_entry, inbox_path
from contract.run_folder import EventLog, RunFolder

TRL = {"rewards/chosen": 0.2, "rewards/rejected": -0.1, "rewards/accuracies": 0.75, "rewards/margins": 0.3,
       "logps/chosen": -12.0, "logps/rejected": -15.0}


def _log(folder: RunFolder, events: list[dict]) -> None:
    log = EventLog(folder.events)
    for event in events:
        log.emit(dict(event))
    log.close()


def _run(folder: RunFolder, metrics: dict, steps: int = 3, evals: dict | None = None) -> None:
    folder.config.write_text("data: {train: pairs.jsonl}\n")
    events: list[dict] = [{"type": "state", "state": "starting", "time": 1.0},
                          {"type": "setup", "total_steps": 9, "time": 1.0}]
    events += [{"type": "train", "step": s, "loss": 0.7 - 0.1 * s, "lr": 0.1, "time": 1.0 + s,
                **{k: v * s for k, v in metrics.items()}} for s in range(1, steps + 1)]
    if evals:
        events.append({"type": "eval", "step": steps, "time": 9.0, **{f"eval/{k}": v for k, v in evals.items()}})
    events.append({"type": "state", "state": "finished", "step": steps, "time": 10.0})
    _log(folder, events)


def test_reward_series_for_a_preference_run_and_none_for_sft(tmp_path):
    history = RunHistory()
    history.update([{"type": "train", "step": s, "loss": 1.0, **TRL, "kl": float("nan") if s == 2 else 0.1}
                    for s in (1, 2)] + [{"type": "eval", "step": 2, "eval/rewards/accuracies": 0.9}])
    series = preference_series(history.train, history.eval)
    assert series["rewards · chosen"] == [(1, 0.2), (2, 0.2)] and series["rewards · rejected"][0] == (1, -0.1)
    assert series["reward accuracy · eval"] == [(2, 0.9)] and series["reward margin · train"][1] == (2, 0.3)
    assert series["log-probability · rejected"] == [(1, -15.0), (2, -15.0)]
    assert series["kl (KTO) · train"] == [(1, 0.1)]  # a non-finite value is left out
    assert not any(name.startswith("nll loss") for name in series)  # ORPO's terms only when logged
    sft = RunHistory()
    sft.update([{"type": "train", "step": 1, "loss": 1.0, "lr": 0.1}])
    assert preference_series(sft.train, sft.eval) == {}

    # the web app: the Train tab's feed carries the rewards plot's points; an SFT run's stays empty
    dpo, plain = RunFolder(tmp_path / "runs" / "dpo").create(), RunFolder(tmp_path / "runs" / "sft").create()
    _run(dpo, TRL, evals={"loss": 0.5, "rewards/accuracies": 0.8})
    _run(plain, {})
    view = RunView(dpo)
    view.poll()
    assert view.series()["rewards"]["reward accuracy · train"] == [(1, 0.75), (2, 1.5), (3, 2.25)]
    assert SPECS["rewards"].hide_empty and SPECS["rewards"].grouped
    backend = Backend(tmp_path / "runs")
    try:
        rewards = json.loads(feed(backend, {"run": str(dpo.root)})["plots"]["train-plot-rewards"])["series"]
        assert rewards["rewards · chosen"]["points"] == [[1, 0.2], [2, 0.4], [3, pytest.approx(0.6)]]
        assert rewards["reward accuracy · eval"]["points"] == [[3, 0.8]]
        assert json.loads(feed(backend, {"run": str(plain.root)})["plots"]["train-plot-rewards"])["series"] == {}
    finally:
        backend.close()
    with gr.Blocks():
        plot = live_plot("rewards", "t-rewards")
    assert "&quot;hide_empty&quot;: true" in plot.html_template  # the page hides it until a point comes

    # the notebook: a preference run's PNG has a row of reward panels under the SFT grid
    def height(png: bytes) -> int:
        return struct.unpack(">II", png[16:24])[1]
    dpo_history, sft_history = RunHistory(), RunHistory()
    dpo_history.update(_events(dpo))
    sft_history.update(_events(plain))
    assert height(render_png(dpo_history)) == 2 * height(render_png(sft_history)) == 960  # 4 reward panels: 2 more rows


def _events(folder: RunFolder) -> list[dict]:
    return [json.loads(line) for line in folder.events.read_text().splitlines()]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    rows = [{"prompt": "reverse: kcodw\n", "chosen": "wdock", "rejected": "kcodw"},
            {"prompt": [{"role": "user", "content": "upper: a|b *x*"}], "chosen": [{"role": "assistant", "content": "A|B"}],
             "rejected": [{"role": "assistant", "content": "a|b"}]}]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "judged.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "sort: cab\n", "completion": "abc", "label": True},
        {"prompt": "sort: cab\n", "completion": "cba", "label": False})))
    return root


def test_the_data_preview_shows_chosen_and_rejected_side_by_side(files):
    info = data_preview(files / "pairs.jsonl")  # the engine's own preview, in a child process
    assert info["ok"] and info["format"] == "preference" and len(info["pairs"]) == 2, info
    # the web app's note under data.train: the prompt, then one table row chosen | rejected
    note = describe_data(info)
    assert "**2 rows**, format **preference**" in note and "first row" not in note
    assert "row 1 · prompt: reverse: kcodw\n\n| chosen | rejected |\n|---|---|\n| wdock | kcodw |" in note
    assert "| assistant: A\\|B | assistant: a\\|b |" in note  # a cell's | and markup stay text
    assert "user: upper: a\\|b \\*x\\*" in note
    # the notebook: an HTML table, the prompt across both columns, the answers side by side
    shown = preview_data(files / "pairs.jsonl")._repr_html_()
    assert "<th" in shown and ">chosen</th>" in shown and ">rejected</th>" in shown
    assert "<td colspan='2'" in shown and "wdock</td><td" in shown and "kcodw</td></tr>" in shown
    assert pairs_html(info["pairs"]) in shown
    # the terminal: the page of rows, both answers on one line of its table
    console = Console(record=True, width=100, force_terminal=False)
    assert preview([str(files / "pairs.jsonl")], console) == 0
    text = console.export_text()
    assert "2 rows, format preference" in text and "rows 1-2 of 2; token lengths: the embedded default" in text
    assert any("wdock" in line and line.index("wdock") < line.rindex("kcodw") for line in text.splitlines()), text
    assert any("A|B" in line and "a|b" in line for line in text.splitlines()), text

    # KTO rows: the completion beside its label
    judged = data_preview(files / "judged.jsonl")
    assert judged["format"] == "unpaired"
    assert "| completion | label |\n|---|---|\n| abc | desirable |" in pairs_markdown(judged["pairs"])
    assert "cba</td><td style='padding:2px 8px;vertical-align:top;white-space:pre-wrap;text-align:left'>" \
           "undesirable" in preview_data(files / "judged.jsonl")._repr_html_()
    console = Console(record=True, width=100, force_terminal=False)
    assert preview([str(files / "judged.jsonl"), "format=unpaired"], console) == 0
    assert any("cba" in line and "undesirable" in line for line in console.export_text().splitlines())
    console = Console(record=True, width=100, force_terminal=False)  # a DPO run would refuse them
    assert preview([str(files / "judged.jsonl"), "objective=dpo"], console) == 1
    said = " ".join(console.export_text().split())
    assert "refused as a whole" in said and "preference.objective dpo trains on preference rows" in said, said
    assert "refused with the" in said and "kept" not in said

    # not a file, and bad usage
    console = Console(record=True, width=100)
    assert preview([str(files / "missing.jsonl")], console) == 1 and "no such file" in console.export_text()
    assert preview([], console) == 2 and preview(["a", "b"], console) == 2
    assert preview(["a", "start=x"], console) == 2 and preview(["a", "overlong=cut"], console) == 2
    assert preview(["a", "objective=ppo"], console) == 2 and "max_length=N" in console.export_text()


def _long_rows(path):
    """45 input/output rows; row 3 is longer than 32 tokens (one token per character + bos, eos)."""
    rows = [{"input": f"reverse: w{n:02d}\n", "output": f"{n:02d}w"} for n in range(45)]
    rows[2] = {"input": "reverse: " + "x" * 30 + "\n", "output": "x" * 30}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_terminal_preview_shows_a_page_of_rows_with_token_lengths_and_pages_on(tmp_path):
    from app.data_preview import rows_page
    path = _long_rows(tmp_path / "io.jsonl")
    console = Console(record=True, width=120, force_terminal=False)
    assert preview([str(path), "max_length=32"], console) == 0
    text = console.export_text()
    page = rows_page(path, max_length=32)  # the page the web app and the notebook show
    assert "45 rows, format input_output" in text and "rows 1-20 of 45; token lengths: the embedded default" in text
    shown = [line for line in text.splitlines() if line.strip().startswith("│")]
    for row in page.rows:  # every row of the page, its token count and its fate on its line
        line = next(line for line in shown if line.split("│")[1].strip() == str(row.number))
        assert f" {row.tokens} " in line and row.fate.split(" (")[0] in line, (row, line)
    assert "truncated to 32 tokens" in text and page.rows[2].tokens == 9 + 31 + 30 + 2
    assert "next page: start=20" in text
    console = Console(record=True, width=120, force_terminal=False)
    assert preview([str(path), "start=40", "overlong=drop", "max_length=32"], console) == 0
    text = console.export_text()
    assert "rows 41-45 of 45" in text and "next page" not in text
    console = Console(record=True, width=120, force_terminal=False)  # under data.overlong error
    assert preview([str(path), "max_length=32", "overlong=error"], console) == 1
    assert "row 3 longer than data.max_length 32" in " ".join(console.export_text().split())
    console = Console(record=True, width=120, force_terminal=False)  # the config's default: 512 tokens
    assert preview([str(path)], console) == 0 and "truncated" not in console.export_text()


def test_the_inbox_lists_a_preference_with_its_rejected_answer_and_margins(tmp_path):
    folder = RunFolder(tmp_path / "runs" / "dpo").create()
    _run(folder, TRL)
    inbox = inbox_path(folder.root)
    add_entry(inbox, "t1", "<s>reverse: ab\n", "ba", 2)
    add_entry(inbox, "t2", "<|user|>reverse: abc<|assistant|>", "cba", 2, rejected="abc")
    add_entry(inbox, "t3", "<|user|>sort: ba<|assistant|>", "ab", 3, rejected="ba")
    forget_entry(inbox, "t3", 3)
    _log(folder, [{"type": "teach", "step": 2, "id": "t2", "answer": "cba", "rejected": "abc", "margin": -0.5},
                  {"type": "teach_check", "step": 3, "id": "t2", "old": "abc", "new": "cba", "learned": True,
                   "margin_before": -0.5, "margin_after": 1.25, "prefers": "chosen"},
                  {"type": "teach", "step": 3, "id": "t3", "answer": "ab", "rejected": "ba", "margin": 0.125}])
    entries = {e["id"]: e for e in data_view(folder).inbox}
    assert margin_text(entries["t1"]) == "" and "rejected" not in entries["t1"]
    assert margin_text(entries["t2"]) == "-0.500 → +1.250 (prefers chosen)"
    assert margin_text(entries["t3"]) == "+0.125 → (not checked yet)"

    # the web app's data panel (Train tab)
    backend = Backend(tmp_path / "runs")
    try:
        with gr.Blocks():
            panel = web_data.DataPanel(
                gr.Dataframe(), gr.Dropdown(), gr.Textbox(), gr.Button(), gr.Button(), gr.Textbox(), gr.Dropdown(),
                gr.Textbox(), gr.Textbox(), gr.Button(), live_plot("seen", "t-seen"), gr.Dataframe(), gr.Dropdown(),
                gr.Button(), gr.Button(), gr.Markdown())
        shown = web_data.show(backend, panel, str(folder.root))
        frame = shown[panel.inbox].set_index("id")
        assert list(frame.columns) == web_data.INBOX_COLUMNS[1:]
        assert frame.loc["t2", "answer (chosen)"] == "cba" and frame.loc["t2", "rejected"] == "abc"
        assert frame.loc["t2", "margin"] == "-0.500 → +1.250 (prefers chosen)"
        assert frame.loc["t2", "learned"] == "yes" and frame.loc["t1", "rejected"] == ""
        assert frame.loc["t3", "removed"] == "yes"
        assert frame.loc["t1", "prompt"] == "reverse: ab" and frame.loc["t2", "prompt"] == "reverse: abc"
        assert shown[panel.entry]["choices"] == [("t1: reverse: ab → ba", "t1"),
                                                 ("t2: reverse: abc → cba over abc", "t2")]

        # the notebook's data fold
        run = Run(folder.root, backend.session)
        controls = DataControls(lambda: run, lambda label, call: None, print)
        controls.refresh()
        heads = [f"<th style='padding:0 8px;text-align:left'>{name}</th>" for name in web_data.INBOX_COLUMNS]
        assert "".join(heads) in controls.inbox.value  # the web app's columns, in its order
        assert "<td style='padding:0 8px'>reverse: abc</td>" in controls.inbox.value  # no special tokens
        assert "&lt;s&gt;" not in controls.inbox.value and "&lt;|user|&gt;" not in controls.inbox.value
        assert "-0.500 → +1.250 (prefers chosen)" in controls.inbox.value
        assert [v for _, v in controls.entry.options] == ["t1", "t2"]
        assert dict(controls.entry.options)["t2: cba over abc"] == "t2"
    finally:
        backend.close()


def test_the_objective_section_comes_right_after_the_method_in_both_forms():
    from app.form import Form
    groups = [(group, title) for group, title, _ in Form().groups()]
    at = groups.index(("method", "Method"))
    assert groups[at + 1] == ("preference", "Objective (SFT or preferences)")
    common = next(c for g, _, c, _ in Form().sections() if g == "preference")
    assert [f["key"] for f in common][:2] == ["preference.objective", "preference.beta"]
    assert "dpo: prefer chosen over rejected" in common[0]["help"]  # the schema's help beside it
