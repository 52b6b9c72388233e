"""The web app's backend with real runs of the embedded default behind it: what the Checkpoints,
Runs and Chat tabs do beyond the browser test (tests/test_web.py) -- resume a new run from a
listed checkpoint, reattach after the app restarted, compare with the base model. That the
web app's Stop and the notebook's stop() end a run alike: tests/test_stop_everywhere.py."""

from __future__ import annotations

import time

import pytest

from app.form import config_from_text
from app.session import SessionError
from app.web.backend import Backend
from contract.run_folder import read_events
from web_page import end_runs

QUIET = "eval: {every_n_steps: 0, at_end: false}\nlogging: {tensorboard: false}\n"


def wait_state(backend: Backend, path: str, states: tuple[str, ...], timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = backend.session.info(path, fresh=True)
        if info.state in states:
            return info
        assert info.state != "failed", backend.session.failure(path)
        time.sleep(0.5)
    pytest.fail(f"run {path} not {states} within {timeout} s: {backend.session.info(path, fresh=True)}")


def wait_step(backend: Backend, path: str, step: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while backend.session.info(path, fresh=True).step < step:
        assert time.monotonic() < deadline, f"run {path} did not reach step {step}"
        time.sleep(0.5)


def losses(path: str) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(f"{path}/events.jsonl") if e["type"] == "train"}


@pytest.fixture
def runs(tmp_path):
    folder = tmp_path / "runs"
    yield folder
    end_runs(folder)


@pytest.mark.slow
def test_resume_a_new_run_from_a_listed_checkpoint(runs):
    backend = Backend(runs)
    try:
        first = backend.session.start(config_from_text(
            QUIET + "train: {max_steps: 30}\ncheckpoint: {every_n_steps: 10, keep_last: 0, save_at_end: false}\n",
            output_dir=str(runs)))
        wait_state(backend, first.path, ("finished",))
        saved = backend.store.saved(first.path)
        checkpoints = {s.step: (s, metrics) for s, metrics in saved if s.kind == "checkpoint"}
        assert sorted(checkpoints) == [10, 20, 30] and all(s.complete for s, _ in checkpoints.values())
        at_10, metrics = checkpoints[10]
        assert metrics["loss"] == losses(first.path)[10]  # each listed with the metrics of its step

        with pytest.raises(SessionError, match="pick a training checkpoint"):
            backend.store.resume_from(first.path, "")
        second = backend.store.resume_from(first.path, at_10.path)
        assert second.name == f"{first.name}-resumed" and second.path != first.path
        wait_state(backend, second.path, ("finished",))
        before, after = losses(first.path), losses(second.path)
        assert sorted(after) == list(range(11, 31))  # the first 10 steps are not trained again
        assert after == {step: before[step] for step in range(11, 31)}  # exactly the same steps
    finally:
        backend.close()


@pytest.mark.slow
def test_reattach_after_the_app_restarted_and_compare_with_the_base_model(runs):
    first_app = Backend(runs)
    info = first_app.session.start(config_from_text(
        QUIET + "method: {name: lora}\noptim: {lr: 0.01}\ntrain: {max_steps: 5000}\n", output_dir=str(runs)))
    wait_step(first_app, info.path, 3)
    first_app.close()  # the app goes away; the run goes on

    app = Backend(runs)  # a new app over the same output folder
    try:
        [listed] = app.session.runs()
        assert (listed.name, listed.alive, listed.state) == (info.name, True, "running")
        assert app.session.attach(info.name).path == info.path
        assert app.watch.trains_adapter(None)  # "compare with base model" is offered for this run
        status = app.watch.status(None)
        assert status["run"] == info.name and status["settings"]["lr"] > 0

        # the Train tab's other live settings (app.web.settings_fold): refused in words, or one set
        from app.web import settings_fold
        with pytest.raises(SessionError, match="Betas: must be numbers separated by a comma"):
            settings_fold.apply_boxes(app, None, {"betas": "0.9; x"})
        with pytest.raises(SessionError, match="betas"):  # the command's rule, before anything is sent
            settings_fold.apply_boxes(app, None, {"betas": "0.9, 1.0"})
        said = settings_fold.apply_boxes(app, None, {"weight_decay": "0.05", "betas": "0.85, 0.99", "eps": ""})
        assert "Weight decay 0.05" in said and "Betas 0.85, 0.99" in said, said
        assert "Weight decay **0.05**" in settings_fold.present_text(app, None)
        sets = [e for e in read_events(f"{info.path}/events.jsonl") if e["type"] == "set"]
        assert sets[-1]["changes"]["weight_decay"] == 0.05 and sets[-1]["changes"]["betas"] == [0.85, 0.99]

        chat = [{"role": "user", "content": "reverse: cat"}]
        answers = []
        for _ in range(2):
            *_, last = app.session.chat(None, chat, compare_base=True, max_new_tokens=8, temperature=1.0, seed=5)
            assert last.done and isinstance(last.base, str)
            answers.append(last)
            wait_step(app, info.path, last.step + 5)
        # the base model is the frozen weights under the adapter: the same seed gives the same
        # base answer whatever the adapter has learnt since
        assert answers[1].step > answers[0].step and answers[1].base == answers[0].base

        final = app.session.stop(None, save=False, wait=True)
        assert not final.alive and final.stopped_by_user
    finally:
        app.close()
