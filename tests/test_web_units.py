"""The web app's backend pieces without a browser: the shared form built from the schema
(app.form, which the notebook uses too), the saved-things listing, the session's errors, the
command line, the preview worker. The run view and the live feed: tests/test_web_views.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import re
import pytest
import yaml

from app.form import DEFAULT_PRESET, Form, config_from_text
from app.session import Session, SessionError, allowed
from app.web.backend.preview import PreviewWorker, describe_data, describe_model
from app.web.backend.store import human_size, list_saved
from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.config.form import schema
from contract.protocol.commands import Pause, Set, allowed_commands
from contract.protocol.states import RunState
from contract.protocol.base import ProtocolError
from contract.presets import PRESETS
from contract.run_folder import RunFolder

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


# -- saved things, CLI ----------------------------------------------------------------------------

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


def test_own_training_data_without_evaluation_data_switches_evaluation_off_instead_of_blocking_start(form, tmp_path):
    from app.web.field_notes import evaluation_off, idle_note
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"reverse: {w}\n", "chosen": w[::-1], "rejected": w}) + "\n"
                            for w in (f"w{n:03d}x" for n in range(80))))
    values = {**form.preset_values(DEFAULT_PRESET), "preference.objective": "dpo", "data.train": str(data)}
    assert values["eval.every_n_steps"] and not values["data.eval"]  # the preset evaluates on the task's split
    assert "eval.every_n_steps" in form.check(values).by_field  # as it was: Start off
    changes, note = evaluation_off(values)
    assert changes == {"eval.every_n_steps": 0} and "Evaluation switched off" in note and "data.eval" in note
    checked = form.check({**values, **changes})
    assert "eval.every_n_steps" not in checked.by_field and checked.ok, checked.problems
    assert evaluation_off({**values, "data.eval": str(data)}) == ({}, "")  # evaluation data given: kept
    assert evaluation_off({**values, "data.train": ""}) == ({}, "")        # the embedded task: its own split
    # with no file yet, the note names the variant of the embedded task the objective trains on
    assert "pairs variant" in idle_note("data.train", "dpo") and "chosen" in idle_note("data.train", "dpo")
    assert "pairs variant" in idle_note("data.train", "simpo")
    assert "instruction rows" in idle_note("data.train", "sft") and "unpaired" in idle_note("data.train", "kto")


def _judged_pairs(path: Path) -> Path:
    """25 pairs: row 4's prompt alone fills 32 tokens, row 6 is longer than 32, row 8 has chosen
    equal to rejected (the embedded default's tokenizer: one token per character)."""
    rows = [{"prompt": f"reverse: w{n:02d}\n", "chosen": f"{n:02d}w", "rejected": f"w{n:02d}"} for n in range(25)]
    rows[3] = {"prompt": "reverse: " + "x" * 40 + "\n", "chosen": "a", "rejected": "b"}
    rows[5] = {"prompt": "reverse: ab\n", "chosen": "y" * 30, "rejected": "z"}
    rows[7] = {"prompt": "p\n", "chosen": "same", "rejected": "same"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_data_files_preview_shows_a_page_of_rows_with_token_lengths_and_what_the_run_does_with_each(tmp_path):
    from app.data_preview import PAGE_ROWS, page_header, rows_page
    from app.notebook.preview import preview_data
    from app.web.field_notes import field_note
    path = _judged_pairs(tmp_path / "pairs.jsonl")
    page = rows_page(path, max_length=32)
    assert len(page.rows) == PAGE_ROWS == 20 and page.total == 25 and [r.number for r in page.rows] == list(range(1, 21))
    fate = {r.number: r.fate for r in page.rows}
    assert fate[4] == "dropped: its prompt alone fills data.max_length 32"
    assert fate[6] == "truncated to 32 tokens (taught live: refused)" and "same answer" in fate[8] and fate[1] == "kept"
    assert page.rows[0].tokens == len("reverse: w00\n") + 3 + 2 and page.rows[0].exact  # + the longer answer, bos, eos
    assert rows_page(path, max_length=32, overlong="error").rows[5].fate.startswith("refused:")
    assert rows_page(path, max_length=32, overlong="drop").rows[5].fate.startswith("dropped: longer")
    assert [r.number for r in rows_page(path, start=20).rows] == [21, 22, 23, 24, 25]
    # what a run refuses as a whole, at start and by a live add_source: rows of another objective's
    # kind (the engine's own words), a row too long under data.overlong error
    assert page.refused is None and rows_page(path, max_length=32, objective="dpo").refused is None
    kto = rows_page(path, max_length=32, objective="kto")
    assert "preference.objective kto trains on unpaired rows" in kto.refused
    assert "refused as a whole, at start and by a live add_source" in page_header(kto)
    assert "row 6 longer than data.max_length 32 under data.overlong error" in \
        rows_page(path, max_length=32, overlong="error").refused
    # the web app's note under data.train: the page as a table (the engine's answer from its preview worker)
    from app.web.backend import Backend
    backend = Backend(tmp_path / "runs")
    try:
        note = field_note(backend, "data.train", str(path), "auto", "dpo", 32, "truncate", "")
    finally:
        backend.close()
    assert "**25 rows**, format **preference**" in note and "rows 1-20 of 25" in note
    assert "| row | prompt | chosen | rejected | tokens | the run |" in note and "truncated to 32 tokens" in note
    # the notebook: the same page as HTML, under the pairs side by side
    shown = preview_data(path, max_length=32)._repr_html_()
    assert "lt-pairs" in shown and "lt-rows" in shown and "its prompt alone fills data.max_length 32" in shown


def test_without_a_file_the_note_shows_the_embedded_tasks_rows_of_the_objectives_variant(tmp_path):
    from app.web.backend import Backend
    from app.web.field_notes import field_note
    backend = Backend(tmp_path / "runs")
    try:
        notes = {o: field_note(backend, "data.train", "", "auto", o, 32, "truncate", "") for o in ("sft", "dpo", "kto", "grpo")}
        first_pair = json.loads(Path(backend.preview.task("dpo")["train"]).read_text().splitlines()[0])
        assert backend.preview.task("nosuch")["ok"] is False
    finally:
        backend.close()
    dpo = notes["dpo"]  # the engine's own pairs variant, its first pair in the table, judged at 32 tokens
    assert "pairs variant" in dpo and "rows 1-20 of 50000; token lengths: the embedded default" in dpo, dpo
    assert "| row | prompt | chosen | rejected | tokens | the run |" in dpo
    assert f"| {first_pair['chosen']} | {first_pair['rejected']} |" in dpo and "| kept |" in dpo
    assert "unpaired variant" in notes["kto"] and "| row | prompt | completion | label |" in notes["kto"]
    assert "| undesirable |" in notes["kto"] and "of 100000" in notes["kto"]
    assert "prompts variant" in notes["grpo"] and "| row | prompt | answer |" in notes["grpo"]
    assert "instruction rows" in notes["sft"] and "| row | input | output |" in notes["sft"]
    assert not any("Cannot" in note or "refused" in note for note in notes.values())
