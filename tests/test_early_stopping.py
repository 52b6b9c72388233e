"""Early stopping: the rule on its own, and a real 1-rank run that ends early with an
`early_stop` event; a run resumed from a checkpoint before the stop ends at the same step (the
count of evaluations without improvement is part of the training checkpoint)."""

from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.events import check_event
from contract.run_folder import read_events
from control_runs import task_files
from engine.evaluation.early_stopping import EarlyStopping


class _Trainer:
    """The little of a trainer the callback touches."""

    def __init__(self):
        self.should_stop, self.events = False, []
        self.state = type("S", (), {"global_step": 0})()

    def emit(self, event):
        self.events.append(check_event(event))  # as the event log records it


def _feed(stopping: EarlyStopping, values: list[float]) -> _Trainer:
    t = _Trainer()
    for step, value in enumerate(values, 1):
        t.state.global_step = step
        signal = stopping.on_evaluate_end(t, {stopping.metric[len("eval/"):]: value, "other": 0.0})
        t.should_stop = signal is not None and signal.stop  # what the loop acts on
        if t.should_stop:
            break
    return t


def test_patience_counts_evaluations_without_an_improvement_beyond_the_threshold():
    t = _feed(EarlyStopping("eval/loss", "min", patience=2, threshold=0.05), [2.0, 1.5, 1.48, 1.47, 1.0])
    assert t.should_stop and t.state.global_step == 4  # 1.48 and 1.47 are within 0.05 of 1.5
    (event,) = t.events
    assert event == {"type": "early_stop", "step": 4, "metric": "eval/loss", "value": 1.47, "best": 1.5,
                     "best_step": 2, "patience": 2, "threshold": 0.05}


def test_an_improvement_resets_the_count_and_max_mode_and_nan():
    t = _feed(EarlyStopping("eval/loss", "min", patience=2), [2.0, 2.1, 1.9, 2.0, 1.8])
    assert not t.should_stop  # never two in a row
    t = _feed(EarlyStopping("accuracy", "max", patience=1), [0.5, 0.6, 0.6])
    assert t.should_stop and t.events[0]["metric"] == "eval/accuracy" and t.events[0]["best"] == 0.6
    t = _feed(EarlyStopping("eval/loss", "min", patience=2), [1.0, float("nan"), float("nan")])
    assert t.should_stop  # a NaN never counts as better


def test_a_metric_the_evaluation_does_not_report_is_a_warning():
    t = _Trainer()
    EarlyStopping("eval/accuracy", "max", patience=1).on_evaluate_end(t, {"loss": 1.0})
    assert not t.should_stop and "eval/accuracy" in t.events[0]["message"] and "loss" in t.events[0]["message"]


def test_the_config_names_what_early_stopping_needs():
    with pytest.raises(ValueError, match="eval.early_stopping_patience: early stopping watches evaluations: "
                       "set eval.every_n_steps or eval.every_n_epochs"):
        load_config(overrides=["eval.early_stopping_patience=2"])
    with pytest.raises(ValueError, match="eval.early_stopping_threshold"):
        load_config(overrides=["eval.early_stopping_threshold=-1"])


def _train(tmp_path: Path, task: dict, name: str, monkeypatch, *extra: str) -> list[dict]:
    """A 1-rank run in this process (the Trainer the worker builds from the same config; no
    launch: what is tested is the loop's stop and its checkpointed count, not the process group)."""
    from engine import Trainer
    monkeypatch.setenv("LIVETUNE_CACHE", task["cache"])
    args = [f"output_dir={tmp_path / 'runs'}", f"run_name={name}", "max_steps=20", "batch_size=8",
            "data.max_length=32", f"data.train={task['train']}", f"data.eval={task['eval']}",
            "precision=fp32", "logging.tensorboard=false", "control.enabled=false", "eval.at_end=false",
            "eval.batch_size=16", "eval.max_samples=16", "eval.every_n_steps=1",
            "eval.early_stopping_patience=2", "eval.early_stopping_threshold=100",  # only the first counts
            "checkpoint.every_n_steps=2", "checkpoint.keep_last=0", "checkpoint.save_at_end=false", *extra]
    with Trainer(config=load_config(overrides=args)) as trainer:
        trainer.train()
    return list(read_events(tmp_path / "runs" / name / "events.jsonl"))


@pytest.mark.slow
def test_a_run_ends_early_and_a_resumed_run_ends_at_the_same_step(tmp_path, monkeypatch):
    task = task_files(tmp_path / "task")
    events = _train(tmp_path, task, "first", monkeypatch)
    (stop,) = [e for e in events if e["type"] == "early_stop"]
    assert (stop["step"], stop["best_step"], stop["metric"]) == (3, 1, "eval/loss")
    assert max(e["step"] for e in events if e["type"] == "train") == 3
    assert [e["state"] for e in events if e["type"] == "state"][-1] == "finished"
    # resumed from step 2, after one evaluation without improvement: one more ends it at step 3
    resumed = _train(tmp_path, task, "resumed", monkeypatch, f"resume={tmp_path / 'runs' / 'first' / 'checkpoints' / 'step-2'}")
    (again,) = [e for e in resumed if e["type"] == "early_stop"]
    assert (again["step"], again["best"]) == (3, stop["best"])
    assert max(e["step"] for e in resumed if e["type"] == "train") == 3
