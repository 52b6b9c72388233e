"""`eval.lm_eval_tasks` in the front ends: a list of entries (task names or local task YAMLs) in
the web app's Evaluation section and the notebook's form, and the harness's results
(eval/lm_eval/<task>/<metric>) among the evaluation metrics each front end plots. Handler level:
the components, the form values and the plot series, no browser or kernel."""

from __future__ import annotations

import json

import gradio as gr
import ipywidgets as widgets

from app.form import ENTRY_LISTS, Form
from app.notebook.form import ConfigForm
from app.series import RunHistory
from app.web.backend.views import RunView
from app.web.configure import ConfigureTab, _component
from contract.run_folder import RunFolder

TASKS = ["arc_easy", "/data/tasks/my_task.yaml"]


def test_the_web_form_takes_the_tasks_as_a_list_of_entries():
    form = Form()
    field = form.field("eval.lm_eval_tasks")
    assert [f["key"] for f in dict((g, c) for g, _, c, _ in form.sections())["eval"]].count(field["key"]) == 1
    with gr.Blocks():
        box = _component(field, form.display(field, TASKS), [], None)
    assert isinstance(box, gr.Dropdown) and box.multiselect and box.allow_custom_value
    offered = [c[0] for c in box.choices]  # the installed harness's task names, searchable
    assert "arc_easy" in offered and "hellaswag" in offered and len(offered) > 1000
    assert box.value == TASKS and "local task YAML" in box.info
    tab = ConfigureTab({"eval.lm_eval_tasks": box})
    assert tab.show({"eval.lm_eval_tasks": "a, b.yaml"}) == {box: ["a", "b.yaml"]}
    values = {**form.preset_values("schema defaults"), **tab.values({box: TASKS})}
    checked = form.check(values, files=False)
    assert checked.ok and checked.config.eval.lm_eval_tasks == TASKS
    assert form.check({**values, **tab.values({box: []})}, files=False).config.eval.lm_eval_tasks == []


def test_the_notebook_form_takes_the_tasks_as_tags(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the names only (their data offline: test_preflight.py)
    form = ConfigForm(preset="schema defaults", validate_live=False)
    tags = form.widgets["eval.lm_eval_tasks"]
    assert isinstance(tags, widgets.TagsInput) and tags.value == []
    yaml_task = tmp_path / "my_task.yaml"  # the notebook's config() checks that a local task YAML exists
    yaml_task.write_text("task: my_task\n")
    tasks = ["arc_easy", str(yaml_task)]
    form.set("eval.lm_eval_tasks", tasks)
    assert tags.value == tasks and form.config().eval.lm_eval_tasks == tasks
    form.update({"eval": {"lm_eval_tasks": ["hellaswag"]}})
    assert tags.value == ["hellaswag"] and form.config().eval.lm_eval_tasks == ["hellaswag"]
    assert "eval.lm_eval_tasks" in ENTRY_LISTS


def test_lm_eval_results_are_plotted_with_the_other_evaluation_metrics(tmp_path):
    folder = RunFolder(tmp_path / "run").create()
    events = [{"type": "train", "step": s, "loss": 3.0 - s / 10, "lr": 0.1} for s in range(1, 5)]
    events += [{"type": "eval", "step": s, "eval/loss": 2.0, "eval/exact_match": 0.1 * s,
                "eval/lm_eval/arc_easy/acc": 0.25 * s, "eval/lm_eval/my_task/perplexity": 9.0 / s} for s in (2, 4)]
    folder.events.write_text("".join(json.dumps(e) + "\n" for e in events))
    view = RunView(folder)
    view.poll()
    plotted = view.series()["eval"]  # the web app's evaluation panel: one line per metric
    assert plotted["lm_eval/arc_easy/acc"] == [(2, 0.5), (4, 1.0)]
    assert plotted["lm_eval/my_task/perplexity"] == [(2, 4.5), (4, 2.25)] and "exact_match" in plotted
    history = RunHistory()  # what the notebook's evaluation panel draws from
    history.update(events)
    assert history.eval["lm_eval/arc_easy/acc"] == [(2, 0.5), (4, 1.0)]
