"""An evaluation mistake never ends a run: an evaluator that raises is skipped with a warning
event naming it and its error, and training goes on to its last step (a real 1-rank run in one
process, with a custom evaluator beside the built-in perplexity)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.run_folder import read_events
from engine.data import default_task

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
from contract.config.load import load_config
from engine import Trainer
from engine.evaluation.evaluators import from_config


class Broken:
    name = "broken_judge"

    def __call__(self, trainer):
        raise KeyError("Spec 'nosuchtask_xyz' is not a registered task")


cfg = load_config(overrides=sys.argv[1:])
Trainer(config=cfg, evaluators=[Broken(), *from_config(cfg)]).train()
"""


@pytest.mark.slow
def test_a_failing_evaluator_is_a_warning_and_the_run_goes_on(tmp_path):
    task = {"cache": str(tmp_path / "cache")}
    for split, n in (("train", 64), ("eval", 16)):  # a small slice of the default task: quick to read
        task[split] = str(tmp_path / f"{split}.jsonl")
        Path(task[split]).write_text("".join(json.dumps(r) + "\n" for r in default_task.make_examples(n, 3, split)))
    env = dict(os.environ, LIVETUNE_CACHE=task["cache"], HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    args = [f"output_dir={tmp_path / 'runs'}", "run_name=broken", "max_steps=4", "batch_size=8",
            "data.max_length=32", f"data.train={task['train']}", f"data.eval={task['eval']}", "precision=fp32",
            "logging.tensorboard=false", "control.enabled=false", "eval.every_n_steps=2", "eval.at_end=false",
            "eval.max_samples=16", "eval.evaluators=[perplexity]", "checkpoint.save_at_end=false"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = list(read_events(tmp_path / "runs" / "broken" / "events.jsonl"))
    warnings = [e for e in events if e["type"] == "warning" and "broken_judge" in e.get("message", "")]
    assert [w["step"] for w in warnings] == [2, 4]
    assert "KeyError" in warnings[0]["message"] and "nosuchtask_xyz" in warnings[0]["message"]
    evals = [e for e in events if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4] and all("eval/loss" in e for e in evals)  # the others ran
    assert max(e["step"] for e in events if e["type"] == "train") == 4
    assert events[-1]["type"] == "state" and events[-1]["state"] == "finished"
