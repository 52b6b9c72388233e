"""Stop means the same in every front end: the web app's Stop button, the notebook's
`Run.stop()`, `RunClient.stop()` in a script and Ctrl-C on `./launch.sh train` (`python -m
app.cli train`), each with nothing more said, take the contract's default (`Stop().save`) and
leave the same outcome: a stop recorded once, a complete checkpoint at the step the run stopped
at, the final model exported, the run finished, no process left.

Four one-rank runs of the embedded default, started at once through each front end's own start
and stopped through its own stop; real processes, real sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from contract.args import config_from_args
from contract.protocol.commands import Stop
from contract.run_folder import read_events
from supervisor import RunManager
from supervisor.client import RunClient
from supervisor.procs import group_alive, kill_group

REPO = Path(__file__).resolve().parents[1]
# a cheap, endless run of the embedded default: only the stop's save may write a model
SMALL = ["max_steps=5000", "data.max_length=32", "batch_size=8", "precision=fp32",
         "eval.every_n_steps=0", "eval.at_end=false", "logging.tensorboard=false",
         "checkpoint.save_at_end=false"]
TIMEOUT_S = 300.0


def train_steps(run_dir: Path) -> int:
    path = run_dir / "events.jsonl"
    steps = [e["step"] for e in read_events(path) if e["type"] == "train"] if path.exists() else []
    return steps[-1] if steps else 0


def wait_until(what: str, check, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout:.0f} s")
        time.sleep(0.2)


def outcome(run_dir: Path) -> dict:
    """What a stop left behind, in the terms every front end promises."""
    events = list(read_events(run_dir / "events.jsonl"))
    states = [e for e in events if e["type"] == "state"]
    stops = [e for e in events if e["type"] == "command" and e.get("cmd") == "stop" and e["status"] == "done"]
    stopping = [e["step"] for e in states if e["state"] == "stopping"]
    saved = [e for e in events if e["type"] == "checkpoint"]
    checkpoint = run_dir / "checkpoints" / Path(saved[-1]["path"]).name if saved else None
    pgid = int((run_dir / "launcher.pid").read_text())
    return {
        "states": [e["state"] for e in states],
        "stop commands": len(stops),
        "checkpoint at the stop step": bool(saved) and saved[-1]["step"] == stopping[-1],
        "checkpoint complete": checkpoint is not None and (checkpoint / "COMPLETE.json").exists(),
        "model exported": (run_dir / "model" / "config.json").exists(),
        "processes left": group_alive(pgid, run_dir),
        # what each front end's run list reads back (the run's summary of its event log)
        "stopped by the user": RunManager(run_dir.parent).get(run_dir.name).info().stopped_by_user,
    }


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """The runs folder; the default assets built once in the test's cache; every run ended after."""
    folder = tmp_path / "runs"
    monkeypatch.setenv("LIVETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LIVETUNE_OUTPUT_DIR", str(folder))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    yield folder
    for pid_file in folder.glob("*/launcher.pid"):
        pgid = int(pid_file.read_text())
        kill_group(pgid, grace_s=2.0, run_dir=pid_file.parent)  # only while the group is the run's


@pytest.mark.slow
def test_every_front_end_stops_the_same_way(runs):
    from app.notebook import api
    from app.web.backend import Backend
    from app.web.train import _act

    assert Stop().save is True
    config = lambda name: config_from_args([*SMALL, f"output_dir={runs}", f"run_name={name}"])  # noqa: E731
    web = Backend(runs)
    terminal = None
    try:
        # started through each front end's own start
        web_path = Path(web.session.start(config("web")).path)
        notebook = api.start(None, *SMALL, "run_name=notebook")
        script = RunManager(runs).start(config("script"))
        terminal_out = runs.parent / "terminal.out"
        terminal = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "train", *SMALL, f"output_dir={runs}", "run_name=terminal"],
            cwd=REPO, env=dict(os.environ), stdout=open(terminal_out, "w"), stderr=subprocess.STDOUT,
            start_new_session=True)  # its own session, as a terminal would give it
        folders = {"web": web_path, "notebook": Path(notebook.path), "script": script.folder.root,
                   "terminal": runs / "terminal"}
        for name, folder in folders.items():
            wait_until(f"run {name} reached step 2", lambda f=folder: train_steps(f) >= 2)

        # stopped through each front end's own stop, nothing more said
        _act(web, "stop", str(web_path))  # the Train tab's Stop button
        notebook.stop()
        with RunClient.connect(script.folder.root, timeout=60) as client:
            client.stop()
        terminal.send_signal(signal.SIGINT)  # Ctrl-C

        assert terminal.wait(timeout=TIMEOUT_S) == 128 + signal.SIGINT, terminal_out.read_text()
        assert script.wait(timeout=TIMEOUT_S)
        wait_until("the web app's run ended", lambda: not web.session.info(str(web_path), fresh=True).alive)
        outcomes = {name: outcome(folder) for name, folder in folders.items()}
        expected = {"states": ["starting", "running", "stopping", "finished"], "stop commands": 1,
                    "checkpoint at the stop step": True, "checkpoint complete": True,
                    "model exported": True, "processes left": False, "stopped by the user": True}
        assert all(o == expected for o in outcomes.values()), outcomes
    finally:
        web.close()
        if terminal is not None and terminal.poll() is None:
            terminal.kill()
