"""`eval.lm_eval_tasks`: lm-evaluation-harness tasks run on the live weights at evaluation time, by
the real entry point, with their results as evaluation metrics equal to the harness's own `hf`
model on the final weights the run saved."""

from __future__ import annotations

import math

import pytest
import yaml

from control_runs import end_leftover_runs  # noqa: F401 - autouse: no run outlives its test
from control_runs import events, launch, logs_of, task_files, wait_exit
from test_openai_api import _evaluate, _task

pytest.importorskip("lm_eval")


@pytest.mark.slow
def test_lm_eval_tasks_are_evaluation_metrics_equal_to_the_harness_on_the_saved_model(tmp_path):
    tasks = []
    for name in ("choice.yaml", "generate.yaml", "loglikelihood.yaml"):  # the tests' tasks, their data filled in
        (tmp_path / name).write_text(yaml.safe_dump(_task(name)))
        tasks.append(str(tmp_path / name))
    run = launch(tmp_path, "lm-eval", task_files(tmp_path / "task"), "nproc=1", "max_steps=6",
                 "eval.at_end=true", "checkpoint.save_at_end=true", f"eval.lm_eval_tasks=[{','.join(tasks)}]")
    assert wait_exit(run, timeout=600) == 0, logs_of(run)
    evaluated = [e for e in events(run) if e["type"] == "eval"][-1]
    reference = _evaluate("hf", {"pretrained": str(run.folder.model), "dtype": "float32"},
                          names=("choice.yaml", "generate.yaml", "loglikelihood.yaml"))["results"]
    assert evaluated["eval/lm_eval/livetune_choice/acc"] == reference["livetune_choice"]["acc,none"]
    assert evaluated["eval/lm_eval/livetune_generate/exact_match"] == \
        reference["livetune_generate"]["exact_match,none"]
    assert math.isclose(evaluated["eval/lm_eval/livetune_loglikelihood/perplexity"],
                        reference["livetune_loglikelihood"]["perplexity,none"], rel_tol=1e-4)
    assert "eval/loss" in evaluated  # beside the run's other evaluators
