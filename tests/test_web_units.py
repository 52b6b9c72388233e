"""The web app's backend pieces without a browser: the shared form built from the schema
(app.form, which the notebook uses too), the run view folded from a real event log, the
saved-things listing, the session's errors, the command line, the preview worker."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import re
import pytest
import yaml

from app.form import DEFAULT_PRESET, Form, config_from_text
from app.session import Session, SessionError, allowed
from app.web.backend.preview import PreviewWorker, describe_data, describe_model
from app.web.backend.store import human_size, list_saved
from app.web.backend.views import MAX_POINTS, RunView
from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.config.form import schema
from contract.protocol.commands import Pause, Set, allowed_commands
from contract.protocol.states import RunState
from contract.protocol.base import ProtocolError
from contract.presets import PRESETS
from contract.run_folder import EventLog, RunFolder

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def form(tmp_path) -> Form:
    return Form(str(tmp_path / "runs"))


# -- the form -------------------------------------------------------------------------------------

def test_form_has_every_schema_field_once_in_groups(form):
    keys = [f["key"] for f in schema()]
    assert form.keys == keys and list(form.values_for()) == keys
    grouped = [f["key"] for _, _, fields in form.groups() for f in fields]
    assert sorted(grouped) == sorted(keys) and len(grouped) == len(set(grouped))
    titles = [title for _, title, _ in form.groups()]
    for wanted in ("Model", "Data", "Method", "Optimization", "Parallelism and DeepSpeed",
                   "Evaluation", "Checkpoints", "Logging"):
        assert wanted in titles


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_values_load_to_the_preset(form, preset):
    checked = form.check(form.preset_values(preset))
    expected = load_config(data={**json.loads(json.dumps(PRESETS[preset])),
                                 "logging": {"output_dir": form.field("logging.output_dir")["default"]}})
    assert checked.ok, checked.problems
    assert checked.config.to_dict() == expected.to_dict()


def test_bad_values_are_kept_next_to_their_fields(form):
    values = form.preset_values(DEFAULT_PRESET)
    values["train.micro_batch_size"] = 0
    values["parallel.nproc"] = 3
    values["parallel.tp_size"] = 2
    values["optim.lr"] = None
    values["parallel.deepspeed"] = "{not json"
    checked = form.check(values)
    assert not checked.ok
    assert checked.by_field["train.micro_batch_size"] == ["must be at least 1, got 0"]
    assert "multiple of 2" in checked.by_field["parallel.nproc"][0]
    assert checked.by_field["optim.lr"] == ["needs a value"]
    assert "not valid YAML or JSON" in checked.by_field["parallel.deepspeed"][0]
    assert not checked.general


def test_problem_owner_is_the_nearest_field(form):
    assert form.owner("parallel.deepspeed.zero_optimization.stage") == "parallel.deepspeed"
    assert form.owner("optim.lr") == "optim.lr"
    assert form.owner("config") is None


def test_lists_and_mappings_round_trip(form):
    values = form.preset_values(DEFAULT_PRESET)
    values["optim.betas"] = "0.8, 0.95"
    values["eval.evaluators"] = "perplexity"
    values["parallel.deepspeed"] = '{"gradient_clipping": "auto"}'
    cfg = form.check(values).config
    assert cfg.optim.betas == [0.8, 0.95]
    assert cfg.eval.evaluators == ["perplexity"]
    assert cfg.parallel.deepspeed == {"gradient_clipping": "auto"}
    again = form.values_for(cfg.to_dict())
    assert again["optim.betas"] == "0.8, 0.95"
    assert json.loads(again["parallel.deepspeed"]) == {"gradient_clipping": "auto"}


def test_yaml_save_and_load(form):
    values = form.preset_values("ZeRO-3, 2 processes")
    text = form.to_yaml(values)
    assert yaml.safe_load(text)["parallel"]["zero_stage"] == 3
    loaded, notes = form.load_yaml(text)
    assert loaded == values and notes == []
    loaded, notes = form.load_yaml("train: {max_steps: 7}\nbogus: 1\n")
    assert loaded["train.max_steps"] == 7
    assert any(n.startswith("bogus:") for n in notes)
    with pytest.raises(ValueError, match="mapping"):
        form.load_yaml("- 1\n- 2\n")


# -- the run view ---------------------------------------------------------------------------------

def _log(folder: RunFolder, events: list[dict]) -> None:
    log = EventLog(folder.events)
    for e in events:
        log.emit(dict(e))
    log.close()


def test_run_view_folds_the_event_log(tmp_path):
    folder = RunFolder(tmp_path / "run").create()
    t0 = time.time() - 11  # the last train record (step 5) was written just now
    _log(folder, [{"type": "state", "state": "starting", "method": "lora", "time": t0},
                  {"type": "setup", "total_steps": 10, "time": t0 + 1},
                  {"type": "state", "state": "running", "time": t0 + 1}]
         + [{"type": "train", "step": s, "epoch": 0, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 100.0,
             "mem_mb": 500.0, "time": t0 + 1 + 2 * s} for s in range(1, 6)]
         + [{"type": "eval", "step": 5, "eval/loss": 4.0, "eval/perplexity": 54.6, "eval/exact_match": 0.25,
             "time": t0 + 20}])
    view = RunView(folder)
    assert view.poll() == 1 and view.poll() == 1  # nothing new: same version
    frames = view.frames(smoothing=0.0)
    loss = frames["loss"]
    assert list(loss[loss.series == "raw"]["loss"]) == pytest.approx([4.9, 4.8, 4.7, 4.6, 4.5])
    assert list(loss[loss.series == "smoothed"]["loss"]) == pytest.approx([4.9, 4.8, 4.7, 4.6, 4.5])
    assert list(loss[loss.series == "eval"]["step"]) == [5]
    assert set(frames["eval"].series) == {"exact_match"}  # loss and perplexity go with the loss
    p = view.progress()
    assert (p.state, p.step, p.total, p.method) == ("running", 5, 10, "lora")
    assert p.eta_s == pytest.approx(10.0, abs=1.0)  # 5 steps left x 2 s per step
    assert view.metrics_at(5) == {"loss": pytest.approx(4.5), "eval/loss": 4.0, "eval/perplexity": 54.6,
                                  "eval/exact_match": 0.25}
    with open(folder.events, "a") as f:  # a line being written is left for the next poll
        f.write('{"type": "train", "step": 6, "loss": 1.0')
    assert view.poll() == 1
    with open(folder.events, "a") as f:
        f.write(', "time": 1}\n')
    assert view.poll() == 2 and view.history.summary.step == 6
    fresh = RunView(folder)  # a page opened later rebuilds the same history
    fresh.poll()
    assert fresh.history.train == view.history.train
    smoothed = fresh.frames(smoothing=0.9)["loss"]
    assert smoothed[smoothed.series == "smoothed"]["loss"].iloc[0] == pytest.approx(4.9)  # debiased


def test_run_view_thins_long_runs_keeping_the_newest_point(tmp_path):
    folder = RunFolder(tmp_path / "run").create()
    _log(folder, [{"type": "train", "step": s, "loss": 1.0, "time": float(s)} for s in range(1, 1001)])
    view = RunView(folder)
    view.poll()
    raw = view.frames()["loss"].query("series == 'raw'")
    assert len(raw) == MAX_POINTS and raw.step.iloc[-1] == 1000 and raw.step.iloc[0] == 1


# -- the Train tab's look at a run -------------------------------------------------------------------

def test_the_train_tabs_look_is_keyed_by_component_and_follows_the_run_state(tmp_path):
    import gradio as gr

    from app.web import train
    from app.web.backend import Backend

    folder = RunFolder(tmp_path / "runs" / "done").create()
    _log(folder, [{"type": "state", "state": "starting", "time": 1.0}, {"type": "setup", "total_steps": 3, "time": 1.0}]
         + [{"type": "train", "step": s, "loss": 3.0 - s, "lr": 0.1, "time": 1.0 + s} for s in (1, 2, 3)]
         + [{"type": "state", "state": "finished", "step": 3, "time": 5.0}])
    backend = Backend(tmp_path / "runs")
    try:
        with gr.Blocks():
            view = train.TrainView(gr.State(None), gr.State(None), gr.Checkbox(), gr.HTML(), gr.HTML(),
                                   gr.Code(), gr.Textbox(), {name: gr.Button() for name in train.COMMAND_OF},
                                   gr.Button(), None, gr.HTML())
        out = train.refresh(backend, view, None, None)  # the page's first look: the newest run
        assert set(out) <= set(view.outputs()) and out[view.run_state] == str(folder.root)
        assert "finished" in out[view.status] and out[view.open_train] is False  # ended: stay put
        assert f"data-run='{folder.root}'" in out[view.marker] and "data-state='finished'" in out[view.marker]
        assert [b["interactive"] for b in (out[button] for button in view.buttons.values())] == \
            [False] * len(view.buttons)  # allowed_commands("finished") is empty
        assert view.lr not in out  # the learning-rate box is never filled in for the user
        # nothing changed: a second look sends neither the status, the buttons nor the marker again
        again = train.refresh(backend, view, str(folder.root), out[view.seen], log_open=True)
        assert view.status not in again and view.marker not in again
        assert not set(view.buttons.values()) & set(again)
        assert view.log in again  # opened: the log tail is sent once
        # a hidden tab is sent nothing but the run it shows (the feed reads it from the marker)
        hidden = train.refresh(backend, view, str(folder.root), again[view.seen], visible=False)
        assert set(hidden) == {view.run_state, view.seen}
        assert set(view.controls("paused")) == {*view.buttons.values(), view.start}
        enabled = {name for name, b in view.buttons.items() if view.controls("paused")[b]["interactive"]}
        assert enabled == {"resume", "stop", "stop_other", "save", "evaluate", "set_lr"}
        assert view.controls("paused")[view.buttons["resume"]]["variant"] == "primary"
        assert view.controls("running")[view.start]["variant"] == "secondary"  # a live run: Start is not primary
        assert view.controls("finished")[view.start]["variant"] == "primary"
        enabled = {name for name, b in view.buttons.items() if view.controls("stopping")[b]["interactive"]}
        assert enabled == {"stop", "stop_other"}  # a second stop ends the group at once
    finally:
        backend.close()


def test_the_live_feed_sends_only_what_the_page_lacks(tmp_path):
    from app.web.backend import Backend
    from app.web.feed import digest, feed

    folder = RunFolder(tmp_path / "runs" / "live").create()
    events = [{"type": "state", "state": "starting", "time": 1.0}, {"type": "setup", "total_steps": 9, "time": 1.0}]
    events += [{"type": "train", "step": s, "loss": 3.0 - s, "lr": 0.1, "time": 1.0 + s} for s in (1, 2, 3)]
    _log(folder, events)
    backend = Backend(tmp_path / "runs")
    run = str(folder.root)
    try:
        first = feed(backend, {"run": run})  # a page that holds nothing yet
        assert first["run"] == run and "step 3 / 9" in first["status"] and first["status_id"] == digest(first["status"])
        assert first["header"].startswith("Talking to run <strong>live</strong>") and "step 3 / 9" in first["header"]
        loss = json.loads(first["plots"]["train-plot-loss"])
        assert loss["path"] == run and loss["series"]["raw"] == {"reset": True, "points": [[1, 2.0], [2, 1.0], [3, 0.0]]}
        # the page now holds all of it: the next answer carries no status, header or points
        have = {i: {"path": run, "last": {k: v["points"][-1] for k, v in json.loads(b)["series"].items()}}
                for i, b in first["plots"].items()}
        known = {"status": first["status_id"], "header": first["header_id"], "version": first["version"]}
        same = feed(backend, {"run": run, "have": have, "known": known})
        assert "status" not in same and "header" not in same and same["plots"] == {}
        # two more steps: the status, the header and only the two new points of each line
        _log(folder, [{"type": "train", "step": s, "loss": 3.0 - s, "lr": 0.1, "time": 1.0 + s} for s in (4, 5)])
        later = feed(backend, {"run": run, "have": have, "known": known})
        assert "step 5 / 9" in later["status"] and "step 5 / 9" in later["header"]
        assert json.loads(later["plots"]["train-plot-loss"])["series"]["raw"] == {
            "reset": False, "points": [[4, -1.0], [5, -2.0]]}
        # the Chat tab on screen wants the header only: no status line, no points
        chat_only = feed(backend, {"run": run, "want": ["header"], "known": {"version": known["version"]}})
        assert "step 5 / 9" in chat_only["header"] and "status" not in chat_only and chat_only["plots"] == {}
        # what a page sends cannot break it: an unknown run or a malformed ask gets a reason back
        assert "error" in feed(backend, {"run": str(tmp_path / "nowhere")})
        assert feed(backend, "not a dict")["error"] == "no run"
        assert "error" not in feed(backend, {"run": run, "have": [1], "known": None})
    finally:
        backend.close()


def test_the_early_script_goes_first_in_the_pages_head_and_nowhere_else():
    import asyncio

    from app.web.early_script import EarlyScript

    def served(path: str, kind: bytes, body: bytes, chunks: int = 2) -> tuple[dict, bytes]:
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())]})
            step = len(body) // chunks + 1
            for i in range(0, len(body), step):
                await send({"type": "http.response.body", "body": body[i:i + step],
                            "more_body": i + step < len(body)})
        sent: list[dict] = []

        async def send(message):
            sent.append(message)
        asyncio.run(EarlyScript(app, b"<script>x</script>")({"type": "http", "method": "GET", "path": path},
                                                              None, send))
        headers = dict(sent[0]["headers"])
        return headers, b"".join(m.get("body", b"") for m in sent[1:])

    page = b"<html><head><title>t</title></head><body>hi</body></html>"
    headers, body = served("/", b"text/html; charset=utf-8", page)
    assert body == page.replace(b"<head>", b"<head><script>x</script>")
    assert int(headers[b"content-length"]) == len(body)
    assert served("/", b"application/json", b'{"<head>": 1}')[1] == b'{"<head>": 1}'
    assert served("/config", b"text/html", page)[1] == page  # only the page itself


# -- saved things, CLI ----------------------------------------------------------------------------

def test_plot_batches_carry_only_what_the_page_lacks():
    from app.web.plots import batch, thin

    points = [(s, 10.0 - s) for s in range(1, 6)]
    first = json.loads(batch({"raw": points}, None, "/r", 1))
    assert first["series"]["raw"] == {"reset": True, "points": [[s, v] for s, v in points]}
    have = {"path": "/r", "last": {"raw": [3, 7.0]}}
    assert json.loads(batch({"raw": points}, have, "/r", 2))["series"]["raw"] == {
        "reset": False, "points": [[4, 6.0], [5, 5.0]]}  # appended points only
    assert batch({"raw": points}, {"path": "/r", "last": {"raw": [5, 5.0]}}, "/r", 3) is None
    # a resumed run trained step 3 again with another loss: the page gets the whole series anew
    rewound = points[:2] + [(3, 1.5)]
    assert json.loads(batch({"raw": rewound}, have, "/r", 4))["series"]["raw"]["reset"] is True
    # another run: everything anew, and a series the run lacks is emptied
    other = json.loads(batch({}, {"path": "/old", "last": {"raw": [1, 1.0]}}, "/r", 5))
    assert other["path"] == "/r" and other["series"] == {}
    gone = json.loads(batch({}, {"path": "/r", "last": {"eval": [1, 1.0]}}, "/r", 6))
    assert gone["series"] == {"eval": {"reset": True, "points": []}}
    long = [(s, float(s)) for s in range(1, 1001)]
    assert len(thin(long)) == MAX_POINTS and thin(long)[-1] == (1000, 1000.0) and thin(long)[0] == (1, 1.0)


def test_the_learning_rate_box_refuses_anything_but_a_number():
    from app.lr_box import ZERO, lr_from_box

    assert lr_from_box(" 0.001 ").lr == 0.001 and lr_from_box("0", confirmed=True).lr == 0.0
    for bad, words in (("", "type a learning rate"), ("abc", "must be a number"), ("-1", "argument 'lr' must be"),
                       ("nan", "argument 'lr' must be"), ("inf", "argument 'lr' must be"), ("0", ZERO)):
        with pytest.raises(SessionError, match=re.escape(words)):
            lr_from_box(bad)


def test_list_saved(tmp_path):
    folder = RunFolder(tmp_path / "run").create()
    for name, size in (("step-10", 1000), ("step-20", 3000), (".tmp-step-30-ab12", 10), ("step-40", 10)):
        (folder.checkpoints / name).mkdir()
        (folder.checkpoints / name / "weights").write_bytes(b"x" * size)
        if name in ("step-10", "step-20"):  # finished saves carry the completion marker
            (folder.checkpoints / name / "COMPLETE.json").write_text("{}")
    folder.model.mkdir()
    (folder.model / "adapter_config.json").write_text("{}")
    saved = list_saved(folder)
    assert [(s.name, s.step, s.kind, s.complete) for s in saved] == [
        ("step-20", 20, "checkpoint", True), ("step-10", 10, "checkpoint", True),
        ("step-40", 40, "checkpoint", False), (".tmp-step-30-ab12", 30, "checkpoint", False),
        ("model", None, "adapter", True)]
    assert saved[0].size_bytes == 3002 and saved[0].size == "2.9 KiB"
    assert human_size(512) == "512 B" and human_size(5 * 2**30) == "5.0 GiB"


def test_the_session_names_unknown_runs_and_bad_configs(tmp_path):
    session = Session(tmp_path / "runs")
    try:
        with pytest.raises(SessionError, match="there is no run yet"):
            session.resolve("")
        with pytest.raises(SessionError, match="no run 'nope'"):
            session.resolve("nope")
        with pytest.raises(ProtocolError, match="set: name at least one of lr"):
            Set()  # a command is checked where it is made, before any run is asked
        with pytest.raises(SessionError, match="no run 'nope'"):
            session.send("nope", Pause())
    finally:
        session.close()
    with pytest.raises(ConfigError, match="no preset 'bogus'"):
        config_from_text("", preset="bogus")
    with pytest.raises(ConfigError, match="train.max_steps"):
        config_from_text("train: {max_steps: -1}")
    with pytest.raises(ConfigError, match="a run config is a mapping"):
        config_from_text("- 1\n")
    cfg = config_from_text("train: {max_steps: 7}", output_dir=str(tmp_path / "elsewhere"))
    assert cfg.train.max_steps == 7 and cfg.optim.lr == PRESETS[DEFAULT_PRESET]["optim"]["lr"]
    assert cfg.logging.output_dir == str(tmp_path / "elsewhere")


def test_the_buttons_follow_the_contracts_table_of_allowed_commands():
    for state in RunState:
        assert allowed(state.value) == allowed_commands(state)
    assert allowed(None) == frozenset() and allowed("no-such-state") == frozenset()
    assert "stop" in allowed("stopping") and "pause" not in allowed("paused")
    assert allowed("finished") == allowed("failed") == frozenset()


def _app(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def test_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _app("--port", str(port))
    assert done.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_password_on_the_command_line_is_refused():
    done = _app("--username", "me", "--password", "secret")  # `ps` would show it to every user
    assert done.returncode == 2 and "LIVETUNE_PASSWORD" in done.stderr and "app.users add" in done.stderr


# -- the preview worker (a real child process running the engine's code) -------------------------

def test_preview_worker_answers_with_the_engines_code(tmp_path, form):
    from engine.data import default_task
    assets = default_task.ensure_default_assets()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) + "\n"
                            for i in range(5)) + "not json\n")
    values = form.preset_values("ZeRO-3, 2 processes")
    worker = PreviewWorker()
    try:
        ds = worker.deepspeed(form.check(values).config.to_dict())
        assert ds["ok"], ds
        assert ds["config"]["zero_optimization"]["stage"] == 3
        assert ds["config"]["train_batch_size"] == 2 * ds["config"]["train_micro_batch_size_per_gpu"]
        assert "auto" not in json.dumps(ds["config"])
        clash = worker.deepspeed({"parallel": {"deepspeed": {"train_micro_batch_size_per_gpu": 3}},
                                  "train": {"max_steps": 5}})
        assert not clash["ok"] and clash["problems"][0][0] == "parallel.deepspeed.train_micro_batch_size_per_gpu"
        model = worker.model(str(assets.model_dir))
        assert model["ok"] and model["parameters"] > 100_000 and model["chat_template"] is True
        assert "M parameters" in describe_model(model)
        assert "Cannot use" in describe_model(worker.model(str(tmp_path)))  # no config.json
        rows = worker.data(str(data))
        assert rows["ok"] and rows["rows"] == 6 and rows["format"] == "chat" and rows["unreadable"] == 1
        assert "6 rows" in describe_data(rows)
        assert "no such file" in worker.data(str(tmp_path / "missing.jsonl"))["error"]
    finally:
        worker.close()


def test_validating_as_the_user_types_leaves_one_yaml_file_per_page():
    from app.web.configure import _yaml_file

    first = _yaml_file("train: {max_steps: 1}\n# h9-test\n")
    assert _yaml_file("train: {max_steps: 1}\n# h9-test\n") == first  # the same config, the same file
    second = _yaml_file("train: {max_steps: 2}\n# h9-test\n", previous=first)
    third = _yaml_file("train: {max_steps: 3}\n# h9-test\n", previous=second)
    assert not Path(first).exists() and not Path(second).exists()
    assert yaml.safe_load(Path(third).read_text()) == {"train": {"max_steps": 3}}
    Path(third).unlink()


def test_every_field_has_a_human_label_and_the_common_ones_come_first():
    from app.form import COMMON

    form = Form()
    assert form.label(form.field("train.micro_batch_size")) == "Micro batch size (train.micro_batch_size)"
    assert form.label(form.field("optim.lr")) == "Learning rate (optim.lr)"
    assert form.label(form.field("model.path")) == "Model folder or hub ID (model.path)"  # its declaration's label=
    assert all(f["label"] and f["label"] != f["key"] and "_" not in f["label"] for f in form.fields)
    sections = form.sections()
    placed = [f["key"] for _, _, common, advanced in sections for f in common + advanced]
    assert sorted(placed) == sorted(form.keys)  # every field once, common or advanced
    assert set(COMMON) <= set(form.keys)
    training = next(common for group, _, common, _ in sections if group == "train")
    assert [f["key"] for f in training][:3] == ["train.max_steps", "train.epochs", "train.micro_batch_size"]
    advanced = {f["key"] for _, _, _, rest in sections for f in rest}
    assert "parallel.master_port" in advanced and "optim.lr" not in advanced


def test_compare_series_puts_several_runs_on_one_set_of_axes(tmp_path):
    from app.web.backend.views import compare_series

    views = {}
    for name, shift in (("a", 0.0), ("b", 1.0)):
        folder = RunFolder(tmp_path / name).create()
        _log(folder, [{"type": "train", "step": s, "loss": 3.0 - s + shift, "time": float(s)} for s in (1, 2)]
             + [{"type": "eval", "step": 2, "eval/loss": 1.5 + shift, "eval/exact_match": 0.25, "time": 3.0}])
        views[name] = RunView(folder)
    series = compare_series(views)
    assert series["compare_loss"] == {"loss · a": [(1, 2.0), (2, 1.0)], "eval loss · a": [(2, 1.5)],
                                      "loss · b": [(1, 3.0), (2, 2.0)], "eval loss · b": [(2, 2.5)]}
    assert series["compare_eval"] == {"exact_match · a": [(2, 0.25)], "exact_match · b": [(2, 0.25)]}
