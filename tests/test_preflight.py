"""The pre-flight check (contract.preflight): every bad input a user can give is found before
any rank starts, named by field, file and row; the terminal exits 2 with that message and no
traceback; the supervisor refuses the same run without making a run folder. Tensor parallelism is
judged through the architecture's own names (GPT-2's n_head) and refused for GPT-2 (AutoTP excludes
it) and Phi-3 (AutoTP cannot split its tp_plan). A command line naming the user's own model and data does not inherit the
embedded default's preset. No ranks are started here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.args import resolve_args
from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.model_facts import CONTEXT_CAP
from contract.preflight import PreflightReport, preflight
from supervisor import RunManager, RunRefused

REPO = Path(__file__).resolve().parent.parent
ROWS = [{"input": f"question {i}", "output": f"answer {i}"} for i in range(12)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny GPT-2 folder (config and tokenizer, no weights): n_positions 64, n_head 4."""
    from transformers import GPT2Config

    from conftest import make_tiny_tokenizer
    folder = tmp_path_factory.mktemp("gpt2")
    GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=128).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines),
                    encoding="utf-8")
    return path


def check(model: Path | None, data_file: Path | None, **sections) -> PreflightReport:
    settings = {"model": {"path": str(model) if model else ""},
                "data": {"train": str(data_file) if data_file else "", "max_length": 64},
                "train": {"max_steps": 2, "micro_batch_size": 1}, **sections}
    return preflight(load_config(data=settings))


def problem_of(report: PreflightReport, key: str) -> str:
    found = [m for k, m in report.problems if k == key]
    assert found, f"no problem on {key}: {report.problems}"
    return " ".join(found)


# -- data files -----------------------------------------------------------------------------------

def test_empty_data_file_is_named(tmp_path, model_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    message = problem_of(check(model_dir, empty), "data.train")
    assert str(empty) in message and "no rows" in message


def test_invalid_utf8_names_file_and_line(tmp_path, model_dir):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + '{"input": "caf\xe9", "output": "x"}\n'.encode("latin-1"))
    message = problem_of(check(model_dir, bad), "data.train")
    assert str(bad) in message and "line 2" in message and "UTF-8" in message


def test_rows_missing_the_formats_keys_are_named_by_row(tmp_path, model_dir):
    path = write_lines(tmp_path / "io.jsonl", [{"input": "a"}, {"input": "b"}, {"question": "c"}])
    report = check(model_dir, path, data={"train": str(path), "format": "input_output", "max_length": 64})
    message = problem_of(report, "data.train")
    assert str(path) in message and "row 1: missing key 'output'" in message and "row 3" in message
    assert "no usable row" in message


def test_dropped_rows_in_a_good_file_are_warned_by_row_number(tmp_path, model_dir):
    rows = [*ROWS[:4], {"input": "no output here"}, *ROWS[4:6], {"input": "x", "output": ""}]
    path = write_lines(tmp_path / "mostly_good.jsonl", rows)
    report = check(model_dir, path)
    assert report.ok, report.problems
    warned = " ".join(m for k, m in report.warnings if k == "data.train")
    assert "2 of 8 rows will be dropped" in warned
    assert "row 5: missing key 'output'" in warned and "row 8: 'output' is empty" in warned


def test_mixed_formats_name_the_rows(tmp_path, model_dir):
    path = write_lines(tmp_path / "mixed.jsonl", [ROWS[0], ROWS[1], {"text": "plain"}])
    message = problem_of(check(model_dir, path), "data.train")
    assert "mixes row formats" in message and "row 1 is input_output" in message and "row 3 is text" in message


def test_json_array_inside_jsonl(tmp_path, model_dir):
    path = tmp_path / "array.jsonl"
    path.write_text(json.dumps(ROWS, indent=1))
    message = problem_of(check(model_dir, path), "data.train")
    assert str(path) in message and "one JSON array" in message and ".json" in message


def test_truncation_over_the_share_is_said_loudly(tmp_path, model_dir):
    long_rows = [{"input": "q", "output": "x" * 200} for _ in range(5)] + ROWS[:5]
    path = write_lines(tmp_path / "long.jsonl", long_rows)
    report = check(model_dir, path)
    assert report.ok
    loud = " ".join(m for _, m in report.loud)
    assert "5 of 10 rows (50%)" in loud and "rows 1, 2, 3, 4, 5" in loud and "truncated" in loud
    assert "tokenizer measured" in loud  # a tokenizer.json is there: the ratio is measured, and said so
    refused = check(model_dir, path, data={"train": str(path), "max_length": 64, "overlong": "error"})
    assert "rows 1, 2, 3, 4, 5" in problem_of(refused, "data.max_length")


def test_chat_data_needs_a_chat_template(tmp_path, model_dir):
    folder = tmp_path / "no_template"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((model_dir / name).read_bytes())
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    path = write_lines(tmp_path / "chat.jsonl", chats)
    assert "no chat template" in problem_of(check(folder, path), "data.format")
    assert check(model_dir, path).ok


# -- DeepSpeed and the model folder --------------------------------------------------------------

def test_deepspeed_dict_contradicting_the_run_config(tmp_path, model_dir):
    path = write_lines(tmp_path / "d.jsonl", ROWS)
    report = check(model_dir, path, parallel={"deepspeed": {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2}}})
    assert "train.micro_batch_size is 1" in problem_of(report, "parallel.deepspeed.train_micro_batch_size_per_gpu")
    assert "parallel.zero_stage is 0" in problem_of(report, "parallel.deepspeed.zero_optimization.stage")
    assert not [k for k, _ in report.problems if "gradient_accumulation" in k]


def test_nonexistent_model_path_with_brackets(tmp_path):
    missing = tmp_path / "models[v2]" / "llama[1]"
    with pytest.raises(ConfigError) as raised:
        load_config(data={"model": {"path": str(missing)}})
    assert raised.value.problems == [("model.path", f"no such folder: {missing} (nor a hub ID such as owner/name)")]


def test_config_json_that_is_not_json(tmp_path, model_dir):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama",')
    (folder / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    message = problem_of(check(folder, None), "model.path")
    assert f"{folder}/config.json is not valid JSON" in message and "line 1" in message


def test_folder_without_config_json_or_tokenizer(tmp_path):
    folder = tmp_path / "just_weights"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    message = problem_of(check(folder, None), "model.path")
    assert "has no config.json" in message and "holds no tokenizer" in message


# -- tensor parallelism through the architecture's own names --------------------------------------

def tp_config(folder: Path) -> dict:
    return {"model": {"path": str(folder)}, "parallel": {"nproc": 2, "tp_size": 2}, "train": {"max_steps": 2}}


def test_gpt2_heads_are_read_by_n_head_and_tp2_is_refused_before_start(model_dir):
    from contract.model_facts import fact, read_model_config
    config = read_model_config(model_dir)
    assert "num_attention_heads" not in config and fact(config, "num_attention_heads") == 4
    # DeepSpeed's AutoTP.supported excludes GPT-2 (tests/test_architectures.py ran it: the ranks
    # failed at deepspeed.initialize), so tp=2 is refused here, naming why
    with pytest.raises(ConfigError) as raised:
        load_config(data=tp_config(model_dir))
    (message,) = [m for k, m in raised.value.problems if k == "parallel.tp_size"]
    assert "'gpt2'" in message and "AutoTP excludes GPT-2" in message


def test_phi3_tp2_is_refused_before_start(tmp_path, model_dir):
    from transformers import Phi3Config
    folder = tmp_path / "phi3"
    Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=128, pad_token_id=0).save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError) as raised:
        load_config(data=tp_config(folder))
    (message,) = [m for k, m in raised.value.problems if k == "parallel.tp_size"]
    assert "'phi3'" in message and "rowwise_split_input" in message


# -- the preset stays with the embedded default -----------------------------------------------------

def test_own_model_and_data_do_not_inherit_the_default_preset(tmp_path, model_dir):
    path = write_lines(tmp_path / "mine.jsonl", ROWS)
    resolved = resolve_args([f"model={model_dir}", f"data.train={path}"])
    cfg = resolved.config
    assert cfg.data.max_length == 64  # the model's n_positions
    assert cfg.eval.every_n_steps == 0 and cfg.eval.every_n_epochs == 0
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 0  # the schema's defaults
    assert resolved.sources["data.max_length"] == "model" and resolved.sources["model.path"] == "override"
    assert "train.max_steps" not in resolved.sources and "optim.lr" not in resolved.sources
    text = resolved.provenance()
    assert "fitted to the model: data.max_length=64 (the context length of the model's config.json)" in text
    assert f"from the command line: model.path={model_dir}" in text
    assert preflight(cfg).ok
    default = resolve_args(["max_steps=3"])
    assert default.config.data.max_length == 32 and default.sources["data.max_length"] == "preset"
    assert default.sources["train.max_steps"] == "override"


def test_context_is_capped_and_explicit_max_length_wins(tmp_path, model_dir):
    from transformers import LlamaConfig
    folder = tmp_path / "long_context"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=32768, vocab_size=128).save_pretrained(folder)
    resolved = resolve_args([f"model={folder}"])
    assert resolved.config.data.max_length == CONTEXT_CAP
    assert f"capped at {CONTEXT_CAP}" in resolved.reasons["data.max_length"]
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"model:\n  path: {folder}\ndata:\n  max_length: 100\n")
    from_file = resolve_args([str(config_file)])
    assert from_file.config.data.max_length == 100 and from_file.sources["data.max_length"] == "config file"


# -- every entry point: the terminal and the supervisor ---------------------------------------------

def run_train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LIVETUNE_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "app.cli", "train", f"output_dir={tmp_path / 'runs'}",
                           "max_steps=2", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_terminal_exits_2_naming_every_problem_without_traceback(tmp_path, model_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    done = run_train(tmp_path, f"model={broken}", f"data.train={empty}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert f"model.path: {broken}/config.json is not valid JSON" in done.stderr
    assert f"data.train: {empty} has no rows" in done.stderr
    assert not (tmp_path / "runs").exists()  # nothing started, no run folder


def test_terminal_names_a_deepspeed_contradiction_and_dropped_rows(tmp_path, model_dir):
    rows = write_lines(tmp_path / "rows.jsonl", [*ROWS[:3], {"input": "no output"}])
    done = run_train(tmp_path, f"model={model_dir}", f"data.train={rows}",
                     'parallel.deepspeed={"gradient_accumulation_steps": 4}')
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "parallel.deepspeed.gradient_accumulation_steps" in done.stderr and "train.grad_accum is 1" in done.stderr
    assert "row 4: missing key 'output'" in done.stderr  # the dropped row, named before start
    assert "fitted to the model: data.max_length=64" in done.stderr


def test_terminal_refuses_rows_the_objective_cannot_train_and_too_few_rows(tmp_path):
    """dpo with an SFT {input, output} file: refused before any rank starts, naming the file, its
    format and the rows dpo needs (the batch check is left to the file that can train)."""
    sft = write_lines(tmp_path / "sft.jsonl", ROWS[:3])
    done = run_train(tmp_path, "preference.objective=dpo", f"data.train={sft}",
                     "train.micro_batch_size=8")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert (f"data.train: {sft} holds input_output rows {{input, output}}, but preference.objective dpo "
            "trains on preference rows {prompt, chosen, rejected}") in done.stderr
    assert "fewer than one global batch" not in done.stderr  # the file is refused already
    assert not (tmp_path / "runs").exists()  # no rank started, no run folder


def test_preference_rows_in_an_sft_run_are_refused_before_start(tmp_path):
    pairs = write_lines(tmp_path / "pairs.jsonl", [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}
                                                   for i in range(8)])
    message = problem_of(check(None, pairs, train={"max_steps": 2, "micro_batch_size": 4}), "data.train")
    assert f"{pairs} holds preference rows {{prompt, chosen, rejected}}" in message
    assert "preference.objective is sft: set preference.objective=dpo or orpo or simpo" in message
    ok = check(None, pairs, train={"max_steps": 2, "micro_batch_size": 4}, preference={"objective": "orpo"})
    assert ok.ok, ok.problems  # the same file, the objective that takes it


def test_terminal_refuses_fewer_rows_than_one_global_batch(tmp_path):
    few = write_lines(tmp_path / "few.jsonl", ROWS[:3])
    done = run_train(tmp_path, f"data.train={few}", "train.micro_batch_size=4", "nproc=2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (f"data.train: {few}: 3 usable rows, fewer than one global batch of 8 (train.micro_batch_size 4 "
            "x 2 data-parallel ranks)") in done.stderr
    assert not (tmp_path / "runs").exists()


def test_unknown_lm_eval_tasks_and_missing_task_yamls_are_refused_before_start(tmp_path):
    """The harness's own task index, read without torch (the app never imports it); the terminal
    exits 2 naming each entry (it used to end the run at the first evaluation)."""
    env = {k: v for k, v in os.environ.items() if k != "LIVETUNE_CACHE"}  # the machine's name index
    done = subprocess.run([sys.executable, "-m", "app.cli", "train", f"output_dir={tmp_path / 'runs'}",
                           "max_steps=2", f"eval.lm_eval_tasks=[nosuchtask_xyz, hellaswg, {tmp_path}/gone.yaml]"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "eval.lm_eval_tasks: 'nosuchtask_xyz' is not a task, group or tag of the installed lm-eval" in done.stderr
    assert "did you mean hellaswag" in done.stderr
    assert f"eval.lm_eval_tasks: no such task YAML file: {tmp_path}/gone.yaml" in done.stderr
    assert not (tmp_path / "runs").exists()
    probe = ("import sys; from contract.lm_eval_names import task_problems, task_names; "
             "assert task_problems(['arc_easy', 'mmlu']) == [] and 'nosuchtask_xyz' not in task_names(); "
             "print('torch' in sys.modules)")
    online = {**env, "HF_HUB_OFFLINE": "0"}  # names only: a run may download the datasets
    torch_free = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=online, capture_output=True,
                                text=True, timeout=600)
    assert torch_free.stdout.strip() == "False", torch_free.stdout + torch_free.stderr


def test_lm_eval_entries_whose_data_is_not_there_offline_are_refused_before_start(tmp_path):
    """Offline (the runs' default), an entry's datasets must be in the Hugging Face cache: a known
    task, a group (mmlu: its 57 subjects), a tag and a task YAML are looked through to their
    datasets (an empty cache here); a YAML over local data files is taken. The terminal exits 2
    naming each, with what to do; no rank starts."""
    rows = write_lines(tmp_path / "rows.jsonl", [{"q": "a", "a": "b"}])
    local = tmp_path / "local.yaml"
    local.write_text(f"task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {rows}\n"
                     "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    hub = tmp_path / "hub.yaml"
    hub.write_text("task: theirs\ndataset_path: nobody/missing_dataset_xyz\ndataset_name: main\n"
                   "doc_to_text: !function utils.doc_to_text\n")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "app.cli", "train", f"output_dir={tmp_path / 'runs'}", "max_steps=2",
                           f"eval.lm_eval_tasks=[arc_easy, mmlu, ai2_arc, {local}, {hub}]"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    said = [line for line in done.stderr.splitlines() if "not in the Hugging Face cache" in line]
    assert any("'arc_easy' needs the dataset allenai/ai2_arc (ARC-Easy)," in line for line in said), said
    assert any("'mmlu' needs the datasets cais/mmlu (abstract_algebra)" in line and "and 54 more" in line
               for line in said), said
    assert any("'ai2_arc' needs the datasets allenai/ai2_arc (ARC-Challenge), allenai/ai2_arc (ARC-Easy)" in line
               for line in said), said
    assert any(f"'{hub}' needs the dataset nobody/missing_dataset_xyz (main)" in line for line in said), said
    assert len(said) == 4 and not any(str(local) in line for line in said), said
    assert "HF_HUB_OFFLINE=0" in said[0] and not (tmp_path / "runs").exists()


def test_supervisor_refuses_the_same_run(tmp_path):
    mixed = write_lines(tmp_path / "mixed.jsonl", [ROWS[0], {"text": "t"}])
    cfg = load_config(data={"data": {"train": str(mixed)}, "train": {"max_steps": 2}})
    manager = RunManager(tmp_path / "runs")
    try:
        with pytest.raises(RunRefused) as raised:
            manager.start(cfg)
    finally:
        manager.close()
    assert [k for k, _ in raised.value.problems] == ["data.train"]
    assert "row 2 is text" in str(raised.value)
    assert not list((tmp_path / "runs").glob("*"))


# -- the form (web app, notebook) and the session ---------------------------------------------------

def test_form_keeps_start_disabled_with_the_message_beside_the_field(tmp_path, model_dir):
    from app.form import Form
    form = Form(output_dir=str(tmp_path / "runs"))
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    values = {**form.preset_values("embedded default"), "model.path": str(no_config)}
    checked = form.check(values)
    assert checked.config is None and not checked.ok  # Start stays disabled
    assert any("has no config.json" in m for m in checked.by_field["model.path"])
    rows = write_lines(tmp_path / "rows.jsonl", [*ROWS, {"input": "lost"}])
    good = form.for_own_model({**form.preset_values("embedded default"), "model.path": str(model_dir),
                               "data.train": str(rows), "train.max_steps": 7})
    assert good["data.max_length"] == 64 and good["eval.every_n_steps"] == 0 and good["optim.lr"] == 1e-3
    assert good["train.max_steps"] == 7  # changed on the form: kept
    checked = form.check(good)
    assert checked.ok, checked.problems
    assert any("row 13: missing key 'output'" in m for m in checked.warnings["data.train"])
    sources = form.sources(good)
    assert sources["train.max_steps"] == "form" and sources["optim.lr"] == "default"
    assert form.sources(form.preset_values("embedded default"))["optim.lr"] == "preset"


def test_the_form_names_an_unknown_lm_eval_task_beside_its_field(tmp_path, monkeypatch):
    from app.form import Form
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the names only (the data offline: the test above)
    form = Form(output_dir=str(tmp_path / "runs"))
    values = {**form.preset_values("embedded default"), "eval.lm_eval_tasks": ["nosuchtask_xyz", "arc_easy"]}
    checked = form.check(values)
    assert not checked.ok and checked.by_field["eval.lm_eval_tasks"] == [
        m for k, m in checked.problems if k == "eval.lm_eval_tasks"]
    assert any("'nosuchtask_xyz' is not a task" in m for m in checked.by_field["eval.lm_eval_tasks"])
    assert not any("arc_easy" in m for m in checked.by_field["eval.lm_eval_tasks"])


def test_session_start_refusal_carries_the_problems(tmp_path):
    from app.session import Session, SessionError
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    session = Session(tmp_path / "runs")
    try:
        with pytest.raises(SessionError) as raised:
            session.start(load_config(data={"data": {"train": str(empty)}, "train": {"max_steps": 2}}))
    finally:
        session.close()
    assert [k for k, _ in raised.value.problems] == ["data.train"] and "has no rows" in str(raised.value)
