"""The Runs tab's table: each run's objective and, for a run that failed or ended early, why."""

from __future__ import annotations

import time
from types import SimpleNamespace

import gradio as gr
import yaml

from app.session import Session
from app.web import runs
from contract.run_folder import EventLog, RunFolder


def _run(root, name: str, objective: str | None, events: list[dict]) -> None:
    folder = RunFolder(root / name).create()
    config = {"run_name": name, **({"preference": {"objective": objective}} if objective else {})}
    folder.config.write_text(yaml.safe_dump(config))
    log = EventLog(folder.events)
    for e in events:
        log.emit(dict(e))
    log.close()


def test_the_runs_table_names_each_objective_and_why_a_run_failed(tmp_path):
    root, t0 = tmp_path / "runs", time.time() - 60
    error = "rank 1 exited with -9 (killed: out of memory?)\nTraceback (most recent call last): ..."
    _run(root, "dpo-run", "dpo", [{"type": "state", "state": "starting", "time": t0},
                                  {"type": "state", "state": "finished", "time": t0 + 5}])
    _run(root, "sft-run", None, [{"type": "state", "state": "starting", "time": t0},
                                 {"type": "state", "state": "failed", "error": error, "time": t0 + 9}])
    session = Session(root)
    try:
        view = runs.RunsView(gr.State(), gr.Tabs(), gr.Dataframe(), gr.Dropdown(), gr.Markdown(), None, gr.Code())
        table = runs._listing(SimpleNamespace(session=session), view, None)[view.table]
    finally:
        session.close()
    rows = {r["run"]: r for r in table.to_dict("records")}
    assert rows["dpo-run"]["objective"] == "dpo" and rows["sft-run"]["objective"] == "sft"
    assert rows["sft-run"]["why it ended"] == "rank 1 exited with -9 (killed: out of memory?)"
    assert rows["dpo-run"]["why it ended"] == ""
