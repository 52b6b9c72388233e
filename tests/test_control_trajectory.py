"""Talking to a run must not change what it learns: a dozen chats, a pause, an evaluation and a
checkpoint in the middle leave every per-step loss exactly as in the same run without them.
Under ZeRO 0, 2 and 3, 2 ranks, real DeepSpeed on CPU, driven through the real entry point."""

import json
import time

import pytest

from supervisor.client import RunClient
from control_runs import end_leftover_runs  # noqa: F401 - autouse: no run outlives its test
from control_runs import (CONNECT_S, HEARTBEAT_S, launch, logged_commands, logs_of, losses, states,
                          task_files, wait_exit, wait_for_step)

STEPS = 36

# The chats sent while paused, one after the other: greedy, sampled, chat template, a stop
# string, and compare_base (a full fine-tune has no separate base model).
CHATS: list[dict] = [
    {"prompt": "sort: banana\n", "max_new_tokens": 8},
    {"prompt": "upper: kite\n", "max_new_tokens": 6, "temperature": 0.9, "top_k": 5, "seed": 3},
    {"prompt": "reverse: moon\n", "max_new_tokens": 6, "temperature": 0.7, "top_p": 0.8, "seed": 4},
    {"messages": [{"role": "user", "content": "sort: pear"}], "max_new_tokens": 6},
    {"prompt": "upper: x\n", "max_new_tokens": 6, "repetition_penalty": 1.3, "stop": ["X"]},
    {"prompt": "reverse: tree\n", "max_new_tokens": 4, "compare_base": True},
]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_files(tmp_path_factory.mktemp("task"))


def ask(client: RunClient, sent: list, request: dict) -> dict:
    """One generate request, answered in full; (request, answer) is kept in `sent`."""
    answer = client.generate(**request).wait()
    sent.append((request, answer))
    return answer


def interrupt(client: RunClient, run) -> dict:
    """The interruptions: a streamed chat while training, a pause holding chats, an evaluation,
    a checkpoint and a gathered status, the first two chats again, a resume, then chats queued
    while training again."""
    seen: dict = {"sent": []}
    wait_for_step(run, 3)
    for attempt in range(3):  # sampled: an untrained model rarely ends at once, greedy often does
        request = {"prompt": "reverse: abcde\n", "max_new_tokens": 8, "temperature": 1.0, "seed": attempt}
        gen = client.generate(**request)
        pieces = list(gen)
        seen["sent"].append((request, gen.result))
        seen["streamed"] = (pieces, gen.result)
        if pieces:
            break
    paused = client.pause()
    seen["paused_at"] = paused.step
    seen["chats"] = [ask(client, seen["sent"], request) for request in CHATS]
    seen["evaluation"] = client.evaluate()
    seen["checkpoint"] = client.save()
    seen["status"] = client.status(ranks=True)
    seen["again"] = [ask(client, seen["sent"], request) for request in CHATS[:2]]
    time.sleep(4 * HEARTBEAT_S)  # several heartbeats go by; the run stays where it is
    seen["still"] = client.status()
    seen["resumed"] = client.resume()
    later = [({"prompt": f"upper: w{i}\n", "max_new_tokens": 5}, None) for i in range(5)]
    streams = [client.generate(**request) for request, _ in later]  # queued together
    seen["later"] = [g.wait() for g in streams]
    seen["sent"] += [(request, answer) for (request, _), answer in zip(later, seen["later"])]
    return seen


def _key(request_args: dict, text: str) -> tuple[str, str]:
    return json.dumps(request_args.get("prompt") or request_args.get("messages")), text


def check_chats(seen: dict, run) -> None:
    """What the chats must show: answered by the paused weights, within their limits; the weights
    did not move while paused (evaluation and save included: the same requests give the same
    answers); each answer the client got is the one the run recorded for that request."""
    paused_at, chats = seen["paused_at"], seen["chats"]
    assert [c.step for c in chats] == [paused_at] * len(CHATS)
    for request, answer in zip(CHATS, chats):
        assert isinstance(answer.text, str) and len(answer.text) <= request["max_new_tokens"], answer
    assert "X" not in chats[4].text
    assert chats[5].base is None and chats[5].note
    assert [a.text for a in seen["again"]] == [c.text for c in chats[:2]]
    assert [a.step for a in seen["again"]] == [paused_at] * 2
    assert all(r.step >= paused_at for r in seen["later"])
    logged = sorted(_key(e["args"], e["result"]["text"]) for e in logged_commands(run, "generate"))
    assert logged == sorted(_key(request, answer.text) for request, answer in seen["sent"])


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_interruptions_leave_every_loss_unchanged(zero, tmp_path, task):
    # The live run trains while it is talked to, as many steps as the CPU makes meanwhile: it
    # never ends by itself and is stopped once past the reference's STEPS. So the schedule must
    # not depend on max_steps: a warm-up ramp, then constant. The pause comes early in the ramp,
    # where a schedule stepped by a pause, chat, evaluation or save would show in the losses.
    common = [f"zero_stage={zero}", "optim.scheduler=constant", "optim.warmup_steps=24"]
    reference = launch(tmp_path, f"quiet{zero}", task, *common, f"max_steps={STEPS}", "control.enabled=false")
    live = launch(tmp_path, f"live{zero}", task, *common, "max_steps=100000")
    client = RunClient.connect(live.folder.root, timeout=CONNECT_S)
    seen = interrupt(client, live)
    wait_for_step(live, STEPS)
    client.stop(save=False)
    assert wait_exit(live) == 0, logs_of(live)
    assert wait_exit(reference) == 0, logs_of(reference)
    assert not (reference.folder.control).exists()

    pieces, result = seen["streamed"]
    assert pieces and "".join(pieces) == result.text and 3 <= result.step < STEPS
    assert seen["paused_at"] < STEPS - 6, "the pause came too late to be in the middle of the run"
    check_chats(seen, live)
    assert seen["evaluation"].step == seen["paused_at"] and seen["evaluation"].metrics["loss"] > 0
    assert seen["status"].memory_of == "every rank" and set(seen["status"].memory_mb) == {"0", "1"}
    assert seen["still"].step == seen["paused_at"] and seen["still"].state == "paused"
    assert seen["checkpoint"].step == seen["paused_at"]
    assert (live.folder.root / seen["checkpoint"].checkpoint).is_dir()

    quiet, loud = losses(reference), losses(live)
    assert sorted(quiet) == list(range(1, STEPS + 1)) and sorted(loud)[:STEPS] == sorted(quiet)
    assert {step: loud[step] for step in quiet} == quiet  # exactly: not approximately
    assert states(live) == ["running", "paused", "running", "stopping", "finished"]
