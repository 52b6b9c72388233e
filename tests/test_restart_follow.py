"""What a user watching a run sees when its group is restarted (fault.max_restarts,
supervisor.restart): `./launch.sh train` keeps following it through the relaunch (it used to stop
in the moment no process was alive and call the run failed), tells the failure and the restart,
and still owns the relaunched group (killed, even by SIGKILL, it takes that group with it); a
client following the run's events (`RunClient.events`, what the web app and the notebook read)
goes on past the gap to the new group's steps; the OpenAI-compatible API answers from the
relaunched group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from contract.config.load import load_config
from contract.run_folder import EventLog, RunFolder, key_of, read_events
from engine.data.default_task import make_examples, prompt_row
from supervisor.client import RunClient
from supervisor.openai_api import ApiServer
from supervisor.procs import group_alive
from supervisor.restart import STARTER, record_starter, relaunch_may_come, starter_lives

REPO = Path(__file__).resolve().parents[1]

# A reward function that takes its rank down once (as the OOM killer would: no exception the
# engine could catch), at the first step after the run's first complete checkpoint.
DIES_ONCE = '''
import os
import signal
from pathlib import Path


def dies_once(prompts, completions, **columns):
    run = Path(os.environ["LIVETUNE_RUN_DIR"])
    if any((run / "checkpoints").glob("step-*/COMPLETE.json")) and not (run / "died").exists():
        (run / "died").write_text("once")
        os.kill(os.getpid(), signal.SIGKILL)
    return [float(len(c)) for c in completions]
'''


def _folder(tmp_path: Path, max_restarts: int, *states: dict) -> RunFolder:
    folder = RunFolder(tmp_path / "r").create()
    folder.config.write_text(load_config(overrides=[f"fault.max_restarts={max_restarts}"]).to_yaml())
    (folder.root / "checkpoints" / "step-2").mkdir(parents=True)
    (folder.root / "checkpoints" / "step-2" / "COMPLETE.json").write_text("{}")
    log = EventLog(folder.events)
    for state in states:
        log.emit({"type": "state", **state})
    log.close()
    return folder


def test_a_watcher_waits_for_a_relaunch_only_while_one_may_come(tmp_path):
    """relaunch_may_come: only while the run's starter lives (the same process, not a reused pid),
    and the relaunch is under way or the restart decision would relaunch the failed group."""
    died = _folder(tmp_path / "a", 1, {"state": "running", "step": 3})  # died without a word
    assert not starter_lives(died) and not relaunch_may_come(died)  # no starter noted
    record_starter(died)
    assert starter_lives(died) and relaunch_may_come(died)
    noted = (died.root / STARTER).read_text()
    (died.root / STARTER).write_text(noted.replace('"started": ', '"started": 1'))  # another process now
    assert not starter_lives(died)
    for n, (max_restarts, state, comes) in enumerate([
            (0, {"state": "running"}, False),  # restarts off
            (1, {"state": "failed", "error": "x"}, True),  # the engine's own record: a restart follows
            (1, {"state": "starting", "source": "manager"}, True),  # the relaunch under way
            (1, {"state": "failed", "source": "manager"}, False),  # the manager's final word
            (1, {"state": "finished"}, False)]):
        folder = _folder(tmp_path / str(n), max_restarts, state)
        record_starter(folder)
        assert relaunch_may_come(folder) == comes, (max_restarts, state)


def _wait_for(path: Path, what, quiet: float = 400.0) -> list[dict]:
    """The run's events once `what(events)` holds; fails only when no new event came for `quiet`
    s (a hang), whatever the machine's speed."""
    seen, deadline = -1, 0.0
    while True:
        events = list(read_events(path)) if path.exists() else []
        if what(events):
            return events
        if len(events) != seen:
            seen, deadline = len(events), time.monotonic() + quiet
        assert time.monotonic() < deadline, [e for e in events if e["type"] in ("state", "rank_failed", "restart")]
        time.sleep(0.2)


def _trained_after_restart(events: list[dict]) -> bool:
    at = [i for i, e in enumerate(events) if e["type"] == "restart"]
    return bool(at) and any(e["type"] == "train" and e["step"] > events[at[-1]]["step"] for e in events[at[-1]:])


@pytest.mark.slow  # two 1-rank starts of a tiny GRPO run through the terminal command
def test_the_terminal_the_event_stream_and_the_api_follow_a_restarted_run(tmp_path):
    cache = str(tmp_path / "cache")
    (tmp_path / "dies.py").write_text(DIES_ONCE)
    # prompt rows of its own: the embedded default's GRPO variant would first train the default
    # task's SFT model (supervisor.warm_start, 500 steps), which has nothing to do with restarts
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(prompt_row(r)) + "\n" for r in make_examples(64, 3, "train")))
    runs = tmp_path / "runs"
    cli = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "train", f"output_dir={runs}", "run_name=r", "nproc=1",
         f"data.train={prompts}", "max_steps=100000", "objective=grpo", "batch_size=2", "grpo.num_generations=2",
         "grpo.max_completion_length=2", "precision=fp32",
         f"grpo.rewards=[{{function: '{tmp_path}/dies.py:dies_once'}}]", "logging.tensorboard=false",
         "checkpoint.save_at_end=false", "eval.at_end=false", "checkpoint.every_n_steps=2",
         "checkpoint.keep_last=1", "fault.max_restarts=1"],
        cwd=REPO, env={**os.environ, "LIVETUNE_CACHE": cache},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    followed: list[dict] = []
    follower = None
    api = ApiServer(runs).start()
    try:
        folder = runs / "r"
        _wait_for(folder / "events.jsonl", lambda ev: any(e["type"] == "train" for e in ev))
        follower = threading.Thread(target=lambda: followed.extend(RunClient(folder).events(follow=True)),
                                    daemon=True)
        follower.start()
        events = _wait_for(folder / "events.jsonl", _trained_after_restart)
        assert cli.poll() is None, "the terminal stopped following at the restart"
        # the follower crossed the gap: it has the new group's steps (bounded by the run's progress)
        _wait_for(folder / "events.jsonl", lambda ev: _trained_after_restart(followed))
        answer = httpx.post(f"{api.url}/chat/completions", timeout=300,
                            headers={"Authorization": f"Bearer {key_of(folder)}"},
                            json={"model": "r", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
        pgid = int((folder / "launcher.pid").read_text())
        os.kill(cli.pid, signal.SIGKILL)  # the terminal dies: its relaunched run goes with it
        output, _ = cli.communicate(timeout=60)
        deadline = time.monotonic() + 120
        while group_alive(pgid, folder) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_alive(pgid, folder), "the relaunched group outlived its terminal"
        follower.join(timeout=200)  # the starter is gone: no relaunch can come, the stream ends
        assert not follower.is_alive(), "the event stream did not end with the run"
    finally:
        api.close()
        if cli.poll() is None:
            cli.kill()
            cli.communicate()
    assert not (runs / "default-sft").exists()  # no warm start: the run began at once
    (failed,) = [e for e in events if e["type"] == "rank_failed"]
    (restarted,) = [e for e in events if e["type"] == "restart"]
    assert "restart 1 of 1" in output and f"rank 0 failed at step {failed['step']}" in output, output
    assert [e["type"] for e in followed].count("restart") == 1
    lines = [e["line"] for e in followed]
    assert lines == sorted(set(lines)), "the stream repeated or reordered events across the gap"
