"""Talking to a run must not change what it learns: a dozen chats, a pause, an evaluation and a
checkpoint in the middle leave every per-step loss exactly as in the same run without them.
Under ZeRO 0, 2 and 3, 2 ranks, real DeepSpeed on CPU, driven through the real entry point."""

import importlib.util
import time

import pytest

from supervisor.client import RunClient
from control_runs import HEARTBEAT_S, launch, logs_of, losses, states, task_files, wait_exit, wait_for_step

HAS_CHECKPOINTS = importlib.util.find_spec("engine.checkpoint") is not None
STEPS = 36


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_files(tmp_path_factory.mktemp("task"))


def interrupt(client: RunClient, run) -> dict:
    """The interruptions: a streamed chat while training, a pause holding chats, an evaluation,
    a checkpoint and a gathered status, a resume, then chats queued while training again."""
    seen: dict = {}
    wait_for_step(run, 3)
    for attempt in range(3):  # sampled: an untrained model rarely ends at once, greedy often does
        gen = client.generate("reverse: abcde\n", max_new_tokens=8, temperature=1.0, seed=attempt)
        pieces = list(gen)
        seen["streamed"] = (pieces, gen.result)
        if pieces:
            break
    paused = client.pause()
    step = paused["step"]
    chats = [client.chat("sort: banana\n", max_new_tokens=8),
             client.chat("upper: kite\n", max_new_tokens=6, temperature=0.9, top_k=5, seed=3),
             client.chat("reverse: moon\n", max_new_tokens=6, temperature=0.7, top_p=0.8, seed=4),
             client.chat(messages=[{"role": "user", "content": "sort: pear"}], max_new_tokens=6),
             client.chat("upper: x\n", max_new_tokens=6, repetition_penalty=1.3, stop=["X"]),
             client.chat("reverse: tree\n", max_new_tokens=4, compare_base=True)]
    seen["evaluation"] = client.evaluate()
    seen["checkpoint"] = client.save() if HAS_CHECKPOINTS else None
    seen["status"] = client.status(ranks=True)
    time.sleep(4 * HEARTBEAT_S)  # several heartbeats go by; the run stays where it is
    seen["still"] = client.status()
    seen["resumed"] = client.resume()
    later = [client.generate(f"upper: w{i}\n", max_new_tokens=5) for i in range(5)]
    seen["later"] = [g.wait() for g in later]
    seen["paused_at"], seen["chats"] = step, chats
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_interruptions_leave_every_loss_unchanged(zero, tmp_path, task):
    common = [f"zero_stage={zero}", f"max_steps={STEPS}"]
    reference = launch(tmp_path, f"quiet{zero}", task, *common, "control.enabled=false")
    live = launch(tmp_path, f"live{zero}", task, *common)
    client = RunClient.connect(live.folder.root, timeout=180)
    seen = interrupt(client, live)
    assert wait_exit(live) == 0, logs_of(live)
    assert wait_exit(reference) == 0, logs_of(reference)
    assert not (reference.folder.control).exists()

    pieces, result = seen["streamed"]
    assert pieces and "".join(pieces) == result["text"] and 3 <= result["step"] < STEPS
    assert seen["paused_at"] < STEPS - 6, "the pause came too late to be in the middle of the run"
    assert all(isinstance(c, str) for c in seen["chats"]) and len(seen["chats"]) + 6 == 12
    assert "loss" in seen["evaluation"]["metrics"]
    assert seen["status"]["memory_of"] == "every rank" and set(seen["status"]["memory_mb"]) == {"0", "1"}
    assert seen["still"]["step"] == seen["paused_at"] and seen["still"]["state"] == "paused"
    assert all(r["step"] >= seen["paused_at"] for r in seen["later"])
    if HAS_CHECKPOINTS:
        assert seen["checkpoint"]["step"] == seen["paused_at"]

    quiet, loud = losses(reference), losses(live)
    assert sorted(loud) == list(range(1, STEPS + 1))
    assert loud == quiet  # exactly: not approximately
    assert states(live) == ["running", "paused", "running", "finished"]
    if not HAS_CHECKPOINTS:
        pytest.xfail("engine.checkpoint is not there yet: the checkpoint part of the test was left out")
