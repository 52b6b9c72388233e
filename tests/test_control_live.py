"""Driving a live 2-rank ZeRO-2 run through its control socket: refused messages, `set lr`,
50 chats at once, an events stream that disconnects and reconnects, and stop-and-save."""

import json
import socket
import threading

import pytest

from supervisor.client import CommandError, RunClient
from control_runs import end_leftover_runs  # noqa: F401 - autouse: no run outlives its test
from control_runs import (CONNECT_S, events, launch, logged_commands, logs_of, states, task_files, wait_exit,
                          wait_for_step)

STEPS = 100_000  # never reached, on any CPU: the test stops the run


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_files(tmp_path_factory.mktemp("task"))


def refused(run, message: bytes) -> dict:
    info = json.loads(run.folder.control.read_text())
    with socket.create_connection((info["host"], info["port"])) as sock:
        sock.sendall(message)
        return json.loads(sock.makefile("rb").readline())


def follow_with_a_break(client: RunClient, got: list, done: threading.Event) -> None:
    """Read events, hang up after 15, reconnect from the next line, read to the end."""
    for event in client.events(from_line=0):
        got.append(event)
        if len(got) == 15:
            break
    for event in client.events(from_line=got[-1]["line"] + 1):
        got.append(event)
    done.set()


@pytest.mark.slow
def test_live_run_takes_commands_and_stops_with_a_save(tmp_path, task):
    run = launch(tmp_path, "live", task, "zero_stage=2", f"max_steps={STEPS}",
                 "optim.scheduler=constant", "optim.warmup_steps=0", "optim.lr=0.002",
                 "checkpoint.save_at_end=false")
    client = RunClient.connect(run.folder.root, timeout=CONNECT_S)
    got, followed = [], threading.Event()
    follower = threading.Thread(target=follow_with_a_break, args=(RunClient(run.folder.root), got, followed))
    follower.start()
    wait_for_step(run, 2)

    # refused while the run goes on: a wrong token, broken JSON, an unknown command
    token = json.loads(run.folder.control.read_text())["token"]
    assert "token" in refused(run, b'{"token": "nope", "id": 1, "cmd": "pause"}\n')["message"]
    assert "malformed" in refused(run, b'{"token": \n')["message"]
    bad = json.dumps({"token": token, "id": 2, "cmd": "explode", "args": {}}).encode() + b"\n"
    assert "unknown command" in refused(run, bad)["message"]
    with pytest.raises(CommandError, match="lr"):
        client.set(lr="fast")
    before = wait_for_step(run, 3)
    assert wait_for_step(run, before + 2) > before and client.status().state == "running"

    changed = client.set(lr=1e-4, grad_clip=0.5, generation={"max_new_tokens": 5})
    at = changed.step
    assert changed.changes["grad_clip"] == 0.5

    # 50 chats sent at once, each answered with its own reply (the default max_new_tokens just set: 5)
    prompts = [f"reverse: w{i:02d}ab\n" for i in range(50)]
    chats = [client.generate(p) for p in prompts]
    streamed = [list(c) for c in chats]
    answers = [c.result for c in chats]
    assert all(a.step >= at and len(a.text) <= 5 for a in answers)
    assert ["".join(pieces) for pieces in streamed] == [a.text for a in answers]

    stop_step = wait_for_step(run, at + 3)
    stopped = client.stop(save=True)
    assert stopped.state == "stopping" and stopped.final_model is True
    assert wait_exit(run) == 0, logs_of(run)
    followed.wait(30)
    follower.join(5)

    log = events(run)
    train = [e for e in log if e["type"] == "train"]
    assert all(e["lr"] == pytest.approx(2e-3) for e in train if e["step"] < at)
    assert all(e["lr"] == pytest.approx(1e-4) for e in train if e["step"] >= at + 1)
    assert stop_step <= train[-1]["step"] < STEPS
    assert states(run) == ["running", "stopping", "finished"]
    sets = [e for e in log if e["type"] == "set"]
    assert len(sets) == 1 and sets[0]["changes"]["lr"] == pytest.approx(1e-4)
    # the run recorded one answer per prompt, the one the client got for that prompt
    logged = logged_commands(run, "generate")
    recorded = {e["args"]["prompt"]: (e["result"]["text"], e["result"]["step"]) for e in logged}
    assert len(logged) == 50 and recorded == {p: (a.text, a.step) for p, a in zip(prompts, answers)}
    # the follower hung up once and reconnected: every line exactly once, in order
    assert [e["line"] for e in got] == list(range(len(log)))
    assert [e["type"] for e in got] == [e["type"] for e in log]
    assert not run.folder.control.exists()
    assert stopped.checkpoint and (run.folder.root / stopped.checkpoint).exists()
    assert (run.folder.model / "config.json").exists()

    # the live settings went into the checkpoint: a resumed run has them again
    last = train[-1]["step"]
    again = launch(tmp_path, "live", task, "zero_stage=2", f"max_steps={STEPS}", "resume=latest",
                   "optim.scheduler=constant", "optim.warmup_steps=0", "optim.lr=0.002",
                   "checkpoint.save_at_end=false")
    assert again.folder.root == run.folder.root
    with RunClient.connect(again.folder.root, timeout=CONNECT_S) as client:
        held = client.pause()  # taken before the first resumed step, or soon after
        settings = client.status().settings
        assert settings["grad_clip"] == 0.5 and settings["generation"]["max_new_tokens"] == 5
        assert len(client.chat("sort: dcba\n")) <= 5
        client.resume()
        wait_for_step(again, held.step + 2)
        client.stop(save=False)
    assert wait_exit(again) == 0, logs_of(again)
    resumed = [e for e in events(again) if e["type"] == "train" and e["time"] > train[-1]["time"]]
    assert resumed[0]["step"] == last + 1 and all(e["lr"] == pytest.approx(1e-4) for e in resumed)
