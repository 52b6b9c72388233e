"""The run manager on real runs: the embedded default (tiny model, few steps) started through the
real launcher and worker, reattached from a second manager, stopped, and broken on purpose (a
rank killed, a rank frozen, a model folder that cannot load). Leftover processes are looked for
in /proc directly, not through the manager's own code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from supervisor import Failure, RunError, RunManager, RunRefused
from supervisor.summary import RunSummary
from contract.config.load import load_config

SHORT = ["data.max_length=32", "batch_size=8", "precision=fp32", "logging.tensorboard=false",
         "checkpoint.save_at_end=false", "eval.at_end=false", "eval.every_n_steps=0"]


def config(tmp_path: Path, name: str, *overrides: str):
    """The embedded default (no model, no data given), made small."""
    return load_config(overrides=[f"output_dir={tmp_path / 'runs'}", f"run_name={name}", *SHORT,
                                  *overrides])


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """One asset cache for every run of this module (the default task is built once)."""
    return {"LIVETUNE_CACHE": str(tmp_path_factory.mktemp("cache")), "LIVETUNE_HEARTBEAT_S": "0.5"}


def group_members(pgid: int) -> list[int]:
    """Every process (zombies included) whose process group is `pgid`, straight from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                found.append(int(entry.name))
    return found


def rss_mb(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def events_of(info) -> list[dict]:
    return [json.loads(line) for line in Path(info.path, "events.jsonl").read_text().splitlines()]


def wait_for(predicate, timeout: float, what: str, handle=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    detail = f"\n{handle.info()}\n{handle.failure()}" if handle is not None else ""
    if handle is not None and handle.pid and group_members(handle.pid):
        os.killpg(handle.pid, signal.SIGKILL)  # leave nothing running behind a failed test
    pytest.fail(f"timed out after {timeout} s waiting for {what}{detail}")


def keep_asking(manager: RunManager, done: threading.Event, errors: list) -> None:
    while not done.is_set():
        try:
            for info in manager.list_runs():
                manager.get(info.name).failure()
            manager.check()
        except Exception as e:  # noqa: BLE001 - collected for the test to show
            errors.append(repr(e))
        time.sleep(0.01)


def wait_running(handle, step: int = 1, timeout: float = 240.0) -> None:
    wait_for(lambda: handle.info().state == "running" and handle.info().step >= step, timeout,
             f"{handle.name} to run step {step}", handle)


def assert_no_process_left(pgid: int) -> None:
    wait_for(lambda: not group_members(pgid), 10.0, f"the processes of group {pgid} to be gone")


# -- without a run ---------------------------------------------------------------------------

def test_summary_folds_events_and_a_resume_starts_over():
    s = RunSummary()
    s.update([{"type": "state", "state": "starting", "time": 10.0},
              {"type": "setup", "total_steps": 4},
              {"type": "state", "state": "running", "step": 0},
              {"type": "train", "step": 4, "epoch": 0, "total_steps": 4, "loss": 1.5, "lr": 0.001},
              {"type": "eval", "step": 4, "eval/loss": 1.2, "eval/exact_match": 0.25},
              {"type": "state", "state": "failed", "error": "boom", "rank": 1, "time": 20.0}])
    assert (s.state, s.step, s.total_steps, s.start_time, s.end_time) == ("failed", 4, 4, 10.0, 20.0)
    assert s.metrics == {"loss": 1.5, "lr": 0.001, "eval/loss": 1.2, "eval/exact_match": 0.25}
    assert (s.error, s.error_rank) == ("boom", 1)
    assert not s.update([{"type": "command", "cmd": "status"}])  # not training progress
    assert s.update([{"type": "state", "state": "starting"}])     # resumed in its own folder
    assert (s.state, s.error, s.end_time) == ("starting", None, None)


def test_unknown_run_is_named_in_the_error(tmp_path):
    manager = RunManager(tmp_path)
    with pytest.raises(RunError, match="no run 'nope'"):
        manager.get("nope")


# -- real runs -------------------------------------------------------------------------------

def test_the_manager_imports_neither_torch_nor_deepspeed():
    code = ("import sys, app, supervisor; heavy = [m for m in ('torch', 'deepspeed', 'gradio') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


@pytest.mark.slow
def test_default_run_finishes_and_is_listed_with_its_metrics(tmp_path, env):
    manager = RunManager(tmp_path / "runs")
    manager.start_monitor(interval=0.2)
    handle = manager.start(config(tmp_path, "short", "max_steps=4"), env=env)
    assert handle.info().state in ("starting", "running")
    # front-end threads asking all the while, as Gradio's would
    errors, done = [], threading.Event()
    readers = [threading.Thread(target=keep_asking, args=(manager, done, errors)) for _ in range(3)]
    for reader in readers:
        reader.start()
    wait_for(lambda: handle.info().state in ("finished", "failed"), 240, "the run to end", handle)
    done.set()
    for reader in readers:
        reader.join()
    manager.stop_monitor()
    assert errors == [] and manager.failures() == []
    info = handle.info()
    assert info.state == "finished", handle.failure()
    assert_no_process_left(handle.pid)

    [listed] = RunManager(tmp_path / "runs").list_runs()  # a fresh manager reads the folder
    assert (listed.name, listed.state, listed.alive) == ("short", "finished", False)
    assert listed.step == listed.total_steps == 4
    assert listed.metrics["loss"] > 0 and "lr" in listed.metrics
    assert listed.start_time <= listed.end_time <= time.time()
    assert listed.error is None and listed.failed_rank is None
    with pytest.raises(RunError, match="not running"):
        manager.attach("short")


@pytest.mark.slow
def test_a_second_manager_reattaches_and_stops_the_run(tmp_path, env):
    first = RunManager(tmp_path / "runs")
    handle = first.start(config(tmp_path, "long", "max_steps=5000"), env=env)
    wait_running(handle, step=2)
    pgid = handle.pid
    ranks = handle.rank_pids()
    assert list(ranks) == [0]
    memory = rss_mb(group_members(pgid))
    assert memory > 100, f"a rank with torch loaded should hold more than {memory:.0f} MiB"

    # the front end "restarts": nothing is shared with the first manager but the folder
    second = RunManager(tmp_path / "runs")
    attached = second.attach("long")
    assert attached.info().state == "running" and attached.pid == pgid
    assert [r.name for r in second.list_runs() if r.alive] == ["long"]
    info = second.stop("long", timeout=180)  # stop saves a checkpoint and the model first (the default)
    assert_no_process_left(pgid)
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks.values())
    assert info.state == "finished" and not info.alive and info.stopped_by_user
    assert 2 <= info.step < 5000
    states = [(e["state"], e.get("source")) for e in events_of(info) if e["type"] == "state"]
    assert states[-2:] == [("stopping", None), ("finished", None)]  # the run stopped itself
    assert second.failure("long") is None
    assert first.get("long").info().state == "finished"
    assert first.check() == []  # a stop is not a failure


@pytest.mark.slow
def test_a_killed_rank_is_reported_within_seconds_and_nothing_is_left(tmp_path, env):
    manager = RunManager(tmp_path / "runs")
    reported: list[tuple[float, Failure]] = []
    seen = threading.Event()
    manager.start_monitor(interval=0.5, on_failure=lambda f: (reported.append((time.monotonic(), f)),
                                                             seen.set()))
    try:
        handle = manager.start(config(tmp_path, "two", "nproc=2", "max_steps=5000"), env=env)
        wait_running(handle, step=2)
        ranks = wait_for(lambda: len(handle.rank_pids()) == 2 and handle.rank_pids(), 30,
                         "both ranks", handle)
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        assert seen.wait(10), f"no failure reported within 10 s: {handle.info()}"
    finally:
        manager.stop_monitor()
    when, failure = reported[0]
    assert when - killed < 10
    assert (failure.run, failure.rank, failure.kind) == ("two", 1, "rank_died")
    assert "SIGKILL" in failure.message
    assert failure.log.endswith("rank1.log") and failure.lines
    assert_no_process_left(handle.pid)

    handle.wait_cleaned_up()  # the manager records the culprit once the group is ended
    [info] = RunManager(tmp_path / "runs").list_runs()  # recorded for later, too
    assert (info.state, info.failed_rank) == ("failed", 1)
    assert "rank 1" in info.error
    again = RunManager(tmp_path / "runs").failure("two")
    assert again.rank == 1 and again.lines


@pytest.mark.slow
def test_a_frozen_rank_is_reported_as_a_hang_and_stopped(tmp_path, env):
    manager = RunManager(tmp_path / "runs", hang_timeout=3.0)
    handle = manager.start(config(tmp_path, "frozen", "max_steps=5000", "control.enabled=false"), env=env)
    wait_running(handle, step=2)
    [rank0] = handle.rank_pids().values()
    os.kill(rank0, signal.SIGSTOP)  # alive, but no step will come
    failures = wait_for(manager.check, 30, "the hang to be reported", handle)
    assert [(f.run, f.kind) for f in failures] == [("frozen", "hung")]
    assert "no training progress" in failures[0].message and failures[0].lines
    assert manager.check() == []  # reported once
    # no control plane, so no save is possible: stop without one (with one, see the next test)
    info = manager.stop("frozen", save=False, timeout=5)  # a stopped process must be continued
    assert_no_process_left(handle.pid)
    assert info.state == "finished" and info.stopped_by_user


@pytest.mark.slow
def test_a_run_whose_model_config_is_broken_is_refused_before_start(tmp_path, env):
    """A config.json cut off half-way is found by the pre-flight check (contract.preflight):
    no rank starts, no run folder is made, and the reason names the file."""
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": ')  # cut off
    manager = RunManager(tmp_path / "runs")
    with pytest.raises(RunRefused) as refused:
        manager.start(config(tmp_path, "broken", f"model.path={model}", "max_steps=2"), env=env)
    assert ("model.path" in [k for k, _ in refused.value.problems]
            and f"{model}/config.json is not valid JSON" in str(refused.value))
    assert not (tmp_path / "runs" / "broken").exists()
