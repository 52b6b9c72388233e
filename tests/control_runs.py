"""Helpers of the control-plane tests: real runs started through the real entry point
(`python -m engine.worker` under the DeepSpeed launcher, supervisor.launch.spawn), and reading their
run folders. Not a test module."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from engine.data import default_task
from contract.config.load import load_config
from contract.run_folder import make_run_folder
from supervisor.launch import LaunchedRun, spawn
from supervisor.procs import group_alive, kill_group
from contract.run_folder import read_events, tail_lines

HEARTBEAT_S = 0.5  # the runs' paused heartbeat, short so a test pause spans many of them
CONNECT_S = 300.0  # how long a run may take to open its control socket (2 ranks starting on a busy machine)
_LAUNCHED: list[LaunchedRun] = []  # ended by `end_leftover_runs` after each test


def task_files(root: Path) -> dict[str, str]:
    """A small slice of the default task (its model, fewer rows): quick to tokenize per rank."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", 2000), ("eval", 48)):
        path = root / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in default_task.make_examples(n, 3, split)))
        paths[split] = str(path)
    return {"train": paths["train"], "eval": paths["eval"], "cache": str(root / "cache")}


def launch(tmp_path: Path, name: str, task: dict, *overrides: str) -> LaunchedRun:
    """Start a 2-rank run of the tiny default model; `overrides` as on the command line."""
    cfg = load_config(overrides=[
        f"output_dir={tmp_path / 'runs'}", f"run_name={name}", "nproc=2", "max_steps=30",
        "batch_size=8", "data.max_length=32", f"data.train={task['train']}", f"data.eval={task['eval']}",
        "precision=fp32", "logging.tensorboard=false", "checkpoint.save_at_end=false",
        "eval.at_end=false", "eval.batch_size=16", "optim.warmup_steps=3", *overrides])
    folder = make_run_folder(cfg)
    run = spawn(cfg, folder, extra_env={"LIVETUNE_CACHE": task["cache"],
                                        "LIVETUNE_HEARTBEAT_S": str(HEARTBEAT_S)})
    _LAUNCHED.append(run)
    return run


@pytest.fixture(autouse=True)
def end_leftover_runs():
    """After each test, end every run it launched that is still going: a failed assertion in the
    middle of a test must not leave a paused 2-rank run holding the machine's cores. (Autouse in
    every test module that imports it; runs launched before the test, e.g. by a module fixture,
    are left alone.)"""
    before = len(_LAUNCHED)
    yield
    while len(_LAUNCHED) > before:
        end_run(_LAUNCHED.pop(), grace_s=5.0)


def end_run(run: LaunchedRun, grace_s: float = 10.0) -> None:
    """End every process of the run, and nothing else: once the run's group is gone its pid may
    lead an unrelated group (a neighbour test worker's), so the group must still be the run's."""
    kill_group(run.pid, grace_s=grace_s,
               alive=lambda: run.process.poll() is None or group_alive(run.pid, run.folder.root))


def logs_of(run: LaunchedRun) -> str:
    parts = []
    for log in sorted(run.folder.logs.glob("*.log")):
        parts.append(f"--- {log.name} ---\n" + "\n".join(tail_lines(log, 40)))
    return "\n".join(parts)


def wait_exit(run: LaunchedRun, timeout: float = 240.0) -> int:
    """The launcher's exit code; on a timeout every process of the run is ended and the test fails."""
    deadline = time.monotonic() + timeout
    while run.process.poll() is None:
        if time.monotonic() > deadline:
            end_run(run)
            pytest.fail(f"run {run.folder.root.name} did not end in {timeout} s\n{logs_of(run)}")
        time.sleep(0.2)
    deadline = time.monotonic() + 15
    while group_alive(run.pid, run.folder.root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(run.pid, run.folder.root), "processes of the run were left behind"
    return run.process.returncode


def events(run: LaunchedRun) -> list[dict]:
    return list(read_events(run.folder.events))


def losses(run: LaunchedRun) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(run) if e["type"] == "train"}


def wait_for_step(run: LaunchedRun, step: int, timeout: float = 180.0) -> int:
    """Wait until the run has logged `step`; returns the newest logged step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [e["step"] for e in events(run) if e["type"] == "train"]
        if done and done[-1] >= step:
            return done[-1]
        if run.process.poll() is not None:
            pytest.fail(f"run ended before step {step}\n{logs_of(run)}")
        time.sleep(0.05)
    end_run(run)
    pytest.fail(f"run did not reach step {step} in {timeout} s\n{logs_of(run)}")


def states(run: LaunchedRun) -> list[str]:
    return [e["state"] for e in events(run) if e["type"] == "state"]


def logged_commands(run: LaunchedRun, cmd: str) -> list[dict]:
    """The run's record of each `cmd` command it finished, in order: the request's `args` (from
    its "queued" event) joined by id with its "done" event (`result`, `step`)."""
    log = events(run)
    args = {e["id"]: e.get("args", {}) for e in log
            if e["type"] == "command" and e["cmd"] == cmd and e["status"] == "queued"}
    return [{**e, "args": args.get(e["id"])} for e in log
            if e["type"] == "command" and e["cmd"] == cmd and e["status"] == "done"]
