"""The run config: YAML + overrides, strict checking with every problem named, the form schema."""

import subprocess
import sys

import pytest
import yaml

from contract.config.schema import ConfigError, RunConfig
from contract.config.load import load_config
from contract.config.form import schema


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"train": {"micro_batch_size": 4, "seed": 7},
                                    "optim": {"lr": "3e-4"}}))
    cfg = load_config(path, ["max_steps=40", "nproc=2", "zero_stage=3", "optim.betas=[0.9, 0.95]",
                             "eval.evaluators=perplexity,exact_match"])
    assert cfg.train.micro_batch_size == 4 and cfg.train.seed == 7
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert (cfg.train.max_steps, cfg.parallel.nproc, cfg.parallel.zero_stage) == (40, 2, 3)
    assert cfg.optim.betas == [0.9, 0.95]
    assert cfg.eval.evaluators == ["perplexity", "exact_match"]


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(overrides=["lr=0.01", "method=lora", "method.lora_r=4"])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_every_problem_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["train.foo=1", "optim.lr=fast", "parallel.zero_stage=7",
                               "nproc=3", "tp=2", "method=lomo", "train.grad_accum=2",
                               "precision=fp8", "bogus"])
    keys = [key for key, _ in err.value.problems]
    for key in ("train.foo", "optim.lr", "parallel.zero_stage", "parallel.nproc",
                "train.grad_accum", "train.precision", "bogus"):
        assert key in keys, (key, keys)
    text = str(err.value)
    assert "unknown key" in text and "must be a number" in text and "at most 3" in text
    assert "'bf16'" in text  # the allowed values are listed


@pytest.mark.parametrize("overrides, key, words", [
    (["pp=2", "nproc=2", "method=lomo"], "method.name", "pipeline"),
    (["tp=2", "nproc=2", "zero_stage=3"], "parallel.tp_size", "ZeRO"),
    (["pp=2", "nproc=2", "zero_stage=2"], "parallel.pp_size", "ZeRO 0 and 1"),
    (["parallel.offload_param=true", "zero_stage=2"], "parallel.offload_param", "zero_stage 3"),
    (["nproc=4", "tp=2", "parallel.dp_size=3"], "parallel.dp_size", "world size"),
    (["data.train=/no/such.jsonl"], "data.train", "no such file"),
    (["model.path=/no/such/folder"], "model.path", "no such folder"),
    (["max_steps=0", "epochs=0"], "train.max_steps", "above 0"),
    (["eval.evaluators=[bleu9]"], "eval.evaluators", "unknown evaluator"),
    (["control.host=0.0.0.0"], "control.host", "hostfile"),
])
def test_impossible_combinations(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    messages = dict(err.value.problems)
    assert key in messages and words in messages[key], messages


def test_eval_schedule_needs_eval_data(tmp_path):
    train = tmp_path / "t.jsonl"
    train.write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError, match="eval.every_n_steps"):
        load_config(overrides=[f"data.train={train}", "eval.every_n_steps=5"])
    load_config(overrides=[f"data.train={train}", f"data.eval={train}", "eval.every_n_steps=5"])


def test_schema_covers_every_field_with_help():
    entries = {e["key"]: e for e in schema()}
    assert entries["train.precision"]["choices"] == ["auto", "bf16", "fp16", "fp32"]
    assert entries["parallel.zero_stage"]["maximum"] == 3
    assert all(e["help"] for e in entries.values())
    flat = set()
    for section, value in RunConfig().to_dict().items():
        if isinstance(value, dict) and section != "resume":
            flat |= {f"{section}.{k}" for k in value}
        else:
            flat.add(section)
    assert flat == set(entries)


def test_config_layer_does_not_import_torch():
    code = "import contract.config.schema, contract.config.load, contract.run_folder, contract.protocol, supervisor.launch, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_paths_are_made_absolute_against_the_directory_they_were_given_in(tmp_path, monkeypatch):
    """The engine's processes start in the project folder and config.yaml is read again later
    (resume, the app): a relative path must keep meaning the file the user named."""
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=["data.train=data.jsonl", "output_dir=out", "parallel.deepspeed={file: ds.json}"])
    assert cfg.data.train == str(tmp_path / "data.jsonl")
    assert cfg.logging.output_dir == str(tmp_path / "out")
    assert cfg.parallel.deepspeed == {"file": str(tmp_path / "ds.json")}
    assert load_config(overrides=["resume=s3://bucket/step-40"]).resume == "s3://bucket/step-40"  # URLs stay
    assert load_config(overrides=["run_name=x", "resume=latest"]).resume == "latest"


@pytest.mark.parametrize("override, key, words", [
    ("max_steps=true", "train.max_steps", "must be an integer, got True (true / false is not a number)"),
    ("optim.lr=nan", "optim.lr", "must be a number, got nan (nan and inf are not numbers)"),
    ("optim.lr=.inf", "optim.lr", "must be a number, got inf"),
    ("optim.betas=[0.9, .nan]", "optim.betas", "got nan (nan and inf are not numbers)"),
])
def test_true_is_not_a_number_nor_are_nan_and_inf(override, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert [k for k, _ in err.value.problems] == [key] and words in str(err.value), str(err.value)


def test_the_trainer_validates_the_config_it_is_given():
    """A config changed in code after loading is refused before anything is built (no process
    group, no run folder)."""
    from engine import Trainer
    cfg = load_config(overrides=["max_steps=2"])
    cfg.optim.lr = -1
    cfg.train.max_steps = True
    with pytest.raises(ConfigError) as err:
        Trainer(config=cfg)
    assert sorted(k for k, _ in err.value.problems) == ["optim.lr", "train.max_steps"]
    assert "must be at least 0.0, got -1" in str(err.value)


def test_the_forms_offer_the_capability_tables_methods():
    """method.name is declared as contract.capabilities.Method: the forms' (and the reference's)
    choices are its values, the config keeps the name as text, and an unknown one is refused with
    the list."""
    from contract.capabilities import Method
    entry = next(e for e in schema() if e["key"] == "method.name")
    assert entry["kind"] == "choice" and entry["choices"] == [m.value for m in Method]
    cfg = load_config(overrides=["method=lora"])
    assert cfg.method.name == "lora" and type(cfg.method.name) is str
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["method=sgd"])
    assert "method.name: must be one of 'full', 'lora'" in str(err.value) and "got 'sgd'" in str(err.value)
