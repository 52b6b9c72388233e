"""Monitor back ends beside events.jsonl: CSV files and Weights & Biases offline, each
chosen in the config and tested by reading what it wrote, against the run's own events."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.preflight import preflight
from contract.run_folder import read_events
from control_runs import task_files
from engine.monitors import CsvSink
from wandb_offline import history

REPO = Path(__file__).resolve().parent.parent


def test_a_number_that_appears_later_widens_the_csv(tmp_path):
    sink = CsvSink(tmp_path)
    sink({"type": "train", "step": 1, "epoch": 0, "time": 1.0, "loss": 2.5, "note": "text is left out"})
    sink({"type": "train", "step": 2, "epoch": 0, "time": 2.0, "loss": 2.0, "grad_norm": 0.5})
    sink({"type": "state", "state": "running"})
    rows = list(csv.DictReader((tmp_path / "train.csv").open()))
    assert [r["loss"] for r in rows] == ["2.5", "2.0"] and [r["grad_norm"] for r in rows] == ["", "0.5"]
    assert list(rows[0]) == ["step", "epoch", "time", "loss", "grad_norm"]
    assert not (tmp_path / "eval.csv").exists()


def test_wandb_without_the_package_is_refused_naming_the_field(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    report = preflight(load_config(overrides=["logging.wandb=offline"]))
    assert any(key == "logging.wandb" and "pip install wandb" in msg for key, msg in report.problems)
    with pytest.raises(ValueError, match="logging.wandb"):
        load_config(overrides=["logging.wandb=cloud"])


SCRIPT = """
import sys
from contract.config.load import load_config
from engine import Trainer
Trainer(config=load_config(overrides=sys.argv[1:])).train()
"""


@pytest.mark.slow
def test_csv_and_wandb_offline_hold_the_runs_numbers(tmp_path):
    task = task_files(tmp_path / "task")
    env = dict(os.environ, LIVETUNE_CACHE=task["cache"], HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    args = [f"output_dir={tmp_path / 'runs'}", "run_name=sinks", "max_steps=4", "batch_size=8",
            "data.max_length=32", f"data.train={task['train']}", f"data.eval={task['eval']}", "precision=fp32",
            "logging.tensorboard=false", "logging.csv=true", "logging.wandb=offline", "control.enabled=false",
            "eval.every_n_steps=2", "eval.at_end=false", "eval.max_samples=16", "checkpoint.save_at_end=false"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "sinks"
    events = list(read_events(run / "events.jsonl"))
    train = [e for e in events if e["type"] == "train"]
    evals = [e for e in events if e["type"] == "eval"]
    assert len(train) == 4 and len(evals) == 2

    rows = list(csv.DictReader((run / "train.csv").open()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["loss"]) for r in rows] == [e["loss"] for e in train]
    assert [float(r["lr"]) for r in rows] == [e["lr"] for e in train]
    eval_rows = list(csv.DictReader((run / "eval.csv").open()))
    assert [float(r["eval/loss"]) for r in eval_rows] == [e["eval/loss"] for e in evals]

    logged = history(run)
    losses = {r["global_step"]: r["train/loss"] for r in logged if "train/loss" in r}
    assert losses == {e["step"]: e["loss"] for e in train}
    assert {r["global_step"]: r["eval/loss"] for r in logged if "eval/loss" in r} == \
        {e["step"]: e["eval/loss"] for e in evals}
