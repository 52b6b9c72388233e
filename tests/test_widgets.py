"""The notebook widgets: the config form against load_config's own messages, the plot series,
and the run panel driven by clicks in a real Jupyter kernel while another cell runs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import ipywidgets as widgets
import pytest
from app.lr_box import lr_from_box
from app.session import SessionError
import yaml

from app.form import ENTRY_LISTS, Form
from app.notebook.form import ConfigForm
from app.series import RunHistory, format_seconds
from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.config.form import schema
from contract.presets import DEFAULT, PRESETS
from nb_utils import REPO, code_notebook, errors_in, run_notebook, widget_states


# -- the form ---------------------------------------------------------------------------------

def test_the_notebook_front_end_imports_neither_torch_nor_deepspeed():
    code = ("import sys, app.notebook; heavy = [m for m in ('torch', 'deepspeed', 'gradio') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_form_has_one_widget_per_schema_field_of_the_right_kind():
    form = ConfigForm(preset="schema defaults")
    entries = schema()
    assert list(form.widgets) == [e["key"] for e in entries]
    kinds = {"choice": widgets.Dropdown, "bool": widgets.Checkbox, "int": widgets.IntText,
             "float": widgets.FloatText, "str": widgets.Text, "list": widgets.Text,
             "dict": widgets.Textarea}
    for entry in entries:
        kind = widgets.TagsInput if entry["key"] in ENTRY_LISTS else kinds[entry["kind"]]  # entry lists
        assert isinstance(form.widgets[entry["key"]], kind), entry["key"]
        if entry["kind"] == "choice":
            assert list(form.widgets[entry["key"]].options) == entry["choices"]
    # with no preset the form holds the schema's defaults, so its config is RunConfig()
    assert form.config().to_dict() == load_config().to_dict()
    assert form.problems == []


def test_the_default_preset_fills_the_form_and_presets_switch():
    form = ConfigForm()
    assert form.config().to_dict() == load_config(data=copy.deepcopy(DEFAULT)).to_dict()
    form.preset.value = "LoRA on a local model folder"
    cfg = form.config()
    assert cfg.method.name == "lora" and cfg.optim.lr == PRESETS["LoRA on a local model folder"]["optim"]["lr"]
    assert cfg.train.max_steps == 0  # the previous preset's values are gone


def test_a_config_shown_in_the_form_comes_back_unchanged(tmp_path):
    cfg = load_config(overrides=["method=lora", "method.lora_target_modules=q_proj,v_proj",
                                 "optim.betas=[0.8,0.95]", "parallel.deepspeed={steps_per_print: 7}",
                                 "eval.evaluators=[perplexity,exact_match]", "lr=2e-4"])
    form = ConfigForm()
    form.load(cfg)
    assert form.get("method.lora_target_modules") == "q_proj, v_proj"
    assert form.config().to_dict() == cfg.to_dict()


def test_bad_values_get_load_configs_own_messages_next_to_their_fields(tmp_path):
    form = ConfigForm()
    form.set("train.max_steps", -3)
    form.set("parallel.nproc", 3)
    form.set("parallel.tp_size", 2)
    form.set("data.train", str(tmp_path / "missing.jsonl"))
    form.set("optim.betas", "0.9")
    data, _ = form.raw()
    with pytest.raises(ConfigError) as expected:
        load_config(data=data)
    # the default preset evaluates every 100 steps: with data of one's own, data.eval is needed
    assert form.problems == expected.value.problems and len(form.problems) == 5
    with pytest.raises(ConfigError) as raised:
        form.config()
    assert str(raised.value) == str(expected.value)
    assert "must be at least 0, got -3" in form.errors["train.max_steps"].value
    assert "nproc must be a multiple of 2" in form.errors["parallel.nproc"].value
    assert "no such file or folder" in form.errors["data.train"].value
    assert "expected two numbers" in form.errors["optim.betas"].value
    assert "names no evaluation data" in form.errors["eval.every_n_steps"].value
    assert form.errors["optim.lr"].value == ""
    assert "invalid run config (5 problems)" in form.summary.value
    form.set("train.max_steps", 10)  # fixed fields lose their message at once
    assert form.errors["train.max_steps"].value == "" and len(form.problems) == 4


def test_a_mapping_field_that_is_not_yaml_is_named():
    form = ConfigForm()
    form.set("parallel.deepspeed", "zero_optimization: {stage: [")
    [(key, message)] = form.problems
    assert key == "parallel.deepspeed" and message.startswith("not valid YAML or JSON")
    assert "not valid YAML or JSON" in form.errors["parallel.deepspeed"].value
    with pytest.raises(KeyError, match="no field 'train.nope'"):
        form.set("train.nope", 1)


def test_flat_keeps_the_deepspeed_mapping_whole():
    flat = Form().flat({"train": {"max_steps": 5}, "parallel": {"deepspeed": {"a": {"b": 1}}}})
    assert list(flat) == ["train.max_steps", "parallel.deepspeed"] and flat["train.max_steps"] == 5
    assert json.loads(flat["parallel.deepspeed"]) == {"a": {"b": 1}}


def test_the_notebook_form_is_the_web_apps_form(tmp_path):
    """One layout-free form behind both front ends: the same fields, the same values for a
    preset, the same config and the same problems for the same values."""
    from app.web.backend import Backend
    widgets_form = ConfigForm(preset="LoRA on a local model folder", output_dir="/tmp/runs-x")
    web_form = Form(output_dir="/tmp/runs-x")
    assert isinstance(widgets_form.form, Form) and widgets_form.form.keys == web_form.keys
    assert widgets_form.values() == web_form.preset_values("LoRA on a local model folder")
    widgets_form.set("train.micro_batch_size", 0)
    values = widgets_form.values()
    assert widgets_form.problems == web_form.check(values).problems == \
        [("train.micro_batch_size", "must be at least 1, got 0")]
    backend = Backend(tmp_path / "runs")
    try:
        assert type(backend.form) is Form and backend.form.keys == web_form.keys
    finally:
        backend.close()


# -- the plain calls' config handling ----------------------------------------------------------

def test_make_config_takes_every_kind_of_config_and_paths_become_absolute(tmp_path, monkeypatch):
    from app.form import make_config

    assert make_config().to_dict() == load_config(data=copy.deepcopy(DEFAULT)).to_dict()
    assert make_config(None, "max_steps=7").train.max_steps == 7
    assert make_config({"train": {"max_steps": 3}}).train.micro_batch_size == 8  # no preset
    (tmp_path / "run.yaml").write_text("train: {max_steps: 9}\n")
    assert make_config(str(tmp_path / "run.yaml"), "lr=0.5").optim.lr == 0.5
    assert make_config(load_config(overrides=["seed=3"]), "max_steps=2").train.seed == 3
    with pytest.raises(ConfigError, match="train.max_steps"):
        make_config(None, "max_steps=-1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "train.jsonl").write_text("{}\n")
    cfg = make_config({"model": {"path": "model"}, "data": {"train": "train.jsonl"},
                       "parallel": {"deepspeed": {"file": "ds.json"}}})
    assert (cfg.model.path, cfg.data.train) == (str(tmp_path / "model"), str(tmp_path / "train.jsonl"))
    assert cfg.parallel.deepspeed == {"file": str(tmp_path / "ds.json")}
    assert cfg.data.eval == "" and cfg.resume == ""  # empty stays empty
    # an fsspec URL stays a URL (the notebook once made s3://... a local path)
    for url in ("s3://bucket/run/checkpoints/step-40", "memory://ckpt/run/checkpoints/step-40"):
        assert make_config(None, f"resume={url}").resume == url


# -- the series -------------------------------------------------------------------------------

def test_history_folds_train_eval_and_a_resume_from_an_earlier_step():
    h = RunHistory()
    h.update([{"type": "state", "state": "starting", "time": 100.0},
              {"type": "setup", "total_steps": 10},
              *[{"type": "train", "step": s, "total_steps": 10, "loss": 5.0 - s, "lr": 0.1,
                 "time": 100.0 + 2 * s} for s in range(1, 5)],
              {"type": "eval", "step": 4, "eval/loss": 1.5, "eval/exact_match": 0.25},
              {"type": "set", "step": 4, "changes": {"lr": 0.05}},
              {"type": "command", "cmd": "set", "status": "done"}])
    assert h.train["loss"] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]
    assert h.eval == {"loss": [(4, 1.5)], "exact_match": [(4, 0.25)]}
    assert h.settings == [{"step": 4, "lr": 0.05}] and len(h.commands) == 1
    assert h.seconds_per_step() == 2.0
    assert h.eta(now=108.0) == 12.0  # 6 steps left at 2 s each
    assert h.summary.step == 4 and h.summary.total_steps == 10
    # launched again from a checkpoint of step 2: steps 3 and 4 are trained anew
    h.update([{"type": "state", "state": "starting"},
              {"type": "train", "step": 3, "total_steps": 10, "loss": 2.5, "time": 200.0}])
    assert h.train["loss"] == [(1, 4.0), (2, 3.0), (3, 2.5)]
    h.update([{"type": "state", "state": "finished", "step": 10}])
    assert h.eta() is None
    assert (format_seconds(None), format_seconds(65), format_seconds(3725)) == ("-", "1:05", "1:02:05")


# -- the panel in a real kernel ---------------------------------------------------------------

SETUP = """
import os, time
from app.notebook import RunPanel
OUT = os.environ["LIVETUNE_OUTPUT_DIR"]
panel = RunPanel(output_dir=OUT)
assert panel.run is None and not panel.start_button.disabled
for key, value in {"train.max_steps": 400, "train.micro_batch_size": 8, "data.max_length": 32,
                   "optim.scheduler": "constant", "optim.warmup_steps": 0,
                   "train.precision": "fp32", "eval.every_n_steps": 0, "eval.at_end": False,
                   "eval.evaluators": "perplexity", "eval.max_samples": 32,
                   "checkpoint.save_at_end": False, "logging.tensorboard": False,
                   "logging.run_name": "clicked"}.items():
    panel.form.set(key, value)
assert panel.form.problems == [], panel.form.problems
panel.start_button.click()
assert panel.run is not None and panel.run.name == "clicked", panel.messages
assert panel.start_button.disabled  # one live run per panel
panel
"""

# this cell is busy with work of its own while the run trains: the widgets must move meanwhile
OTHER_WORK = """
samples, total, deadline = [], 0, time.monotonic() + 300
while time.monotonic() < deadline:
    total += sum(i * i for i in range(20_000))  # the kernel's own work
    samples.append((panel.progress.value, panel.plots_drawn, panel.history.summary.state))
    if panel.progress.value >= 4 and panel.plots_drawn >= 2:
        break
    time.sleep(0.2)
first, last = samples[0], samples[-1]
assert last[0] >= 4 and last[0] > first[0], (first, last, panel.messages)
assert last[1] >= 2 and panel.plot.value[:4] == b"\\x89PNG"
assert last[2] == "running" and "running" in panel.progress_label.value
assert panel.progress.max == 400
assert not panel.pause_button.disabled and panel.resume_button.disabled
print("widget moved from", first, "to", last, "while this cell ran")
"""

CONTROLS = """
def wait_until(predicate, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {panel.messages}"
        time.sleep(0.1)

h = panel.history
# the learning-rate box is empty; its placeholder follows the run's present rate
from app.notebook.panel import lr_placeholder
wait_until(lambda: panel.lr.placeholder == lr_placeholder(h.latest("lr")), "the present lr in the box")
assert panel.lr.value == ""
panel.lr.value = "5e-4"
panel.lr_button.click()
panel.wait_idle(120)
assert panel.lr.value == ""  # sent: the placeholder shows the present rate again
wait_until(lambda: panel.lr.placeholder == "now 5.00e-04", "the box to follow the new lr")
wait_until(lambda: h.settings, "the change to reach the event log")
assert abs(h.settings[-1]["lr"] - 5e-4) < 1e-12, (h.settings, panel.messages)
set_at = h.settings[-1]["step"]
wait_until(lambda: h.summary.step >= set_at + 2, "steps after the lr change")
assert [lr for s, lr in h.train["lr"] if s > set_at] and \\
    all(abs(lr - 5e-4) < 1e-12 for s, lr in h.train["lr"] if s > set_at), h.train["lr"][-5:]

# the other live settings (the extras' settings fold): one set of the filled boxes
panel.settings.boxes["weight_decay"].value = "0.05"
panel.settings.boxes["betas"].value = "0.85, 0.99"
panel.settings.apply_button.click()
panel.wait_idle(120)
wait_until(lambda: any("weight_decay" in c for c in h.settings), "the settings to reach the event log")
assert [c for c in h.settings if "weight_decay" in c][-1]["betas"] == [0.85, 0.99], h.settings
wait_until(lambda: "Weight decay <b>0.05</b>" in panel.settings.present.value, "the present values")
assert all(box.value == "" for box in panel.settings.boxes.values())

panel.pause_button.click()
wait_until(lambda: h.summary.state == "paused", "the pause")
wait_until(lambda: panel.pause_button.disabled and not panel.resume_button.disabled, "the buttons")
paused_at = h.summary.step
panel.chat.input.value = "reverse: abc"
panel.chat.send_button.click()
answer = panel.chat.wait(120)
assert panel.chat.answered == 1 and panel.chat.transcript[-1] == ("assistant", answer), panel.messages
assert f"step {paused_at}" in panel.chat.view.value  # answered by the paused weights
assert h.summary.step == paused_at and h.summary.state == "paused"

panel.evaluate_button.click()  # default task: held-out data to evaluate on
panel.wait_idle(120)
wait_until(lambda: "loss" in h.eval, "the evaluation")

panel.resume_button.click()
wait_until(lambda: h.summary.state == "running" and h.summary.step > paused_at, "training to go on")
"""

# a notebook opened later on the running run: it reattaches and redraws the whole history
REATTACH = """
second = RunPanel(output_dir=OUT)
assert second.run is not None and second.run.name == "clicked"
wait_until(lambda: second.history.summary.step >= h.summary.step - 1 and second.plots_drawn, "the redraw")
assert second.history.train["loss"][0][0] == 1  # from the first step on
assert second.picker.value == "clicked"
second.detach()
"""

STOP = """
panel.stop_button.click()
panel.wait_idle(120)
wait_until(lambda: h.summary.final, "the run to end")
assert h.summary.state == "finished", h.summary
wait_until(lambda: not panel.start_button.disabled, "Start to come back")
assert panel.pause_button.disabled and panel.stop_button.disabled
print("stopped at step", h.summary.step)
"""


@pytest.mark.slow
def test_the_panel_drives_a_run_by_clicks_while_other_cells_run(tmp_path, monkeypatch):
    monkeypatch.setenv("LIVETUNE_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("LIVETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LIVETUNE_HEARTBEAT_S", "0.5")
    nb = code_notebook(*(textwrap.dedent(c) for c in (SETUP, OTHER_WORK, CONTROLS, REATTACH, STOP)))
    client = run_notebook(nb, cwd=tmp_path, tmp=tmp_path, timeout=600)
    assert errors_in(nb) == []
    shown = [o for o in nb.cells[0].outputs if o.get("output_type") == "execute_result"]
    assert "application/vnd.jupyter.widget-view+json" in shown[0]["data"]
    # what the front end was sent: the progress bar's updates arrived while the cells ran
    progress = [s for s in widget_states(client, "IntProgressModel") if s.get("max") == 400]
    assert progress and progress[0]["value"] >= 4
    events = [json.loads(line) for line in (tmp_path / "runs" / "clicked" / "events.jsonl").read_text().splitlines()]
    commands = [e["cmd"] for e in events if e["type"] == "command" and e["status"] == "done"]
    assert commands[:6] == ["set", "set", "pause", "generate", "evaluate", "resume"]  # lr, then the other settings
    assert commands[-1] == "stop"


# -- resuming from an fsspec URL through the plain calls --------------------------------------

QUICK = ("max_steps=20", "batch_size=16", "data.max_length=32", "precision=fp32", "eval.every_n_steps=0",
         "eval.at_end=false", "logging.tensorboard=false", "checkpoint.save_at_end=false")


@pytest.mark.slow
def test_resume_from_an_fsspec_url_through_the_notebook_api(tmp_path, monkeypatch):
    """A checkpoint named by URL reaches the run as that URL: `file://` (which the ranks can
    read) resumes exactly; `memory://` (which lives in one process only) gets the engine's own
    message about that very URL, not one about a local path made from it."""
    from app.notebook import api
    from contract.run_folder import read_events

    monkeypatch.setenv("LIVETUNE_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)

    def losses(run) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in read_events(run.handle.folder.events) if e["type"] == "train"}

    first = api.start(None, *QUICK, "checkpoint.every_n_steps=10", "checkpoint.keep_last=0", "run_name=first")
    assert first.wait(timeout=300).state == "finished", first.failure()
    url = (first.path / "checkpoints" / "step-10").as_uri()  # file:///.../checkpoints/step-10
    resumed = api.start(None, *QUICK, f"resume={url}", "run_name=resumed")
    memory = "memory://livetune-test/run/checkpoints/step-10"
    elsewhere = api.start(None, *QUICK, f"resume={memory}", "run_name=memory")
    assert resumed.wait(timeout=300).state == "finished", resumed.failure()
    assert yaml.safe_load((resumed.path / "config.yaml").read_text())["resume"] == url
    before, after = losses(first), losses(resumed)
    assert sorted(after) == list(range(11, 21)) and after == {s: before[s] for s in range(11, 21)}

    assert yaml.safe_load((elsewhere.path / "config.yaml").read_text())["resume"] == memory
    with pytest.raises(api.RunFailed) as failed:
        elsewhere.wait(timeout=300)
    assert f"resume={memory}: no such checkpoint folder" in str(failed.value), failed.value


def test_the_form_says_how_to_get_widgets_where_they_cannot_be_drawn():
    from app.notebook.form import ConfigForm

    bundle = ConfigForm()._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert "application/vnd.jupyter.widget-view+json" in data  # a widget front end draws the widget
    assert "./launch.sh notebook" in data["text/plain"] and "VBox(" not in data["text/plain"]
    assert "jupyterlab_widgets" in data["text/html"]


def test_the_panel_refuses_to_set_an_untouched_learning_rate_box(tmp_path):
    from app.notebook.panel import RunPanel

    panel = RunPanel(output_dir=tmp_path / "runs", attach_live=False)
    try:
        assert panel.lr.value == "" and panel.lr.style.description_width == "initial"  # its label shown whole
        for typed in ("", "0", "-1e-3", "fast", "inf"):
            panel.lr.value = typed
            assert panel.set_lr() is None, typed
            with pytest.raises(SessionError) as refused:  # the web page's rule and words (app.lr_box)
                lr_from_box(typed)
            assert panel.messages[-1] == (str(refused.value), True)
    finally:
        panel.close()
