"""The OpenAI-compatible API as OpenAI's clients expect it, against one real run (one rank of the
tiny default model, started through the real entry point and held paused, so its weights stay):
its keys are there from the start, `echo` gives the prompt back exactly as sent, every streamed
chunk carries `system_fingerprint`, and a seeded sample is the same whether it shared a
generation with other waiting requests or ran alone."""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from contract.protocol.completion_commands import Complete
from contract.run_folder import KEY_FILE, VIEWER_KEY_FILE, key_of, read_events
from control_runs import end_leftover_runs  # noqa: F401 - autouse: no run outlives its test
from control_runs import CONNECT_S, end_run, launch, task_files
from supervisor.client import RunClient
from supervisor.openai_api import ApiServer

openai = pytest.importorskip("openai")

FINGERPRINT = re.compile(r"step-\d+-seed-\d+")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The run (paused once it answers), whether its keys existed before anything asked for
    them, the API over its output folder, and the official client with the run's own key."""
    tmp = tmp_path_factory.mktemp("served")
    run = launch(tmp, "api", task_files(tmp / "task"), "nproc=1", "max_steps=100000")
    keys_at_start = {f: stat.S_IMODE(os.stat(run.folder.root / f).st_mode)
                     for f in (KEY_FILE, VIEWER_KEY_FILE) if (run.folder.root / f).exists()}
    server = ApiServer(tmp / "runs").start()
    client = None
    try:
        client = RunClient.connect(run.folder.root, timeout=CONNECT_S)
        client.pause()
        api = openai.OpenAI(base_url=server.url, api_key=key_of(run.folder.root), max_retries=0, timeout=300)
        yield run, keys_at_start, client, api
    finally:
        if client is not None:
            client.close()
        server.close()
        end_run(run, grace_s=5.0)


@pytest.mark.slow
def test_a_runs_api_keys_are_there_when_it_starts(served):
    _, keys_at_start, _, api = served
    assert keys_at_start == {KEY_FILE: 0o600, VIEWER_KEY_FILE: 0o600}
    assert [m.id for m in api.models.list().data] == ["api"]


@pytest.mark.slow
def test_echo_gives_the_prompt_back_exactly_as_sent(served):
    api = served[3]
    prompt = "reverse: abc\n"
    scored = api.completions.create(model="api", prompt=prompt, max_tokens=0, echo=True, logprobs=0).choices[0]
    assert scored.text == prompt  # no "<s>" in front
    lp = scored.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.text_offset)
    # each token's offset points at its text within what came back (the BOS takes no room)
    assert all(scored.text[o:o + len(t)] == t for t, o in zip(lp.tokens[1:], lp.text_offset[1:]))
    answered = api.completions.create(model="api", prompt=[prompt, "sort: dcba\n"], max_tokens=4, echo=True,
                                      temperature=0).choices
    assert answered[0].text.startswith(prompt) and answered[1].text.startswith("sort: dcba\n")


@pytest.mark.slow
def test_every_streamed_chunk_carries_the_fingerprint_that_repeats_it(served):
    api = served[3]
    chat = list(api.chat.completions.create(model="api", messages=[{"role": "user", "content": "sort: dcba"}],
                                            max_tokens=6, temperature=1.0, seed=5, stream=True,
                                            stream_options={"include_usage": True}))
    completion = list(api.completions.create(model="api", prompt="reverse: kernel\n", max_tokens=6,
                                             temperature=1.0, stream=True))
    for chunks in (chat, completion):
        prints = {c.system_fingerprint for c in chunks}
        assert len(chunks) >= 3 and len(prints) == 1 and FINGERPRINT.fullmatch(prints.pop() or ""), chunks
    assert chat[0].system_fingerprint.endswith("-seed-5")
    # the seed a stream without one reports repeats its sample (the run is paused: the same weights)
    seed = int(completion[0].system_fingerprint.rsplit("-", 1)[1])
    again = api.completions.create(model="api", prompt="reverse: kernel\n", max_tokens=6, temperature=1.0, seed=seed)
    assert again.choices[0].text == "".join(c.choices[0].text for c in completion if c.choices)


@pytest.mark.slow
def test_a_seeded_sample_is_the_same_batched_with_waiting_requests_or_alone(served):
    """Requests of one temperature that wait at one boundary share a generation (left-padded to
    the longest prompt, each sampling from its own seed): each seeded sample equals the one its
    request gets alone."""
    run, _, client, api = served
    asks = [dict(prompt="reverse: kernel panic\n", n=2, seed=3),
            dict(prompt="sort: z\n", seed=4),
            dict(prompt=["reverse: hello\n", "sort: a much longer prompt here\n"], seed=5)]

    def ask(kwargs: dict) -> list[str]:
        done = api.completions.create(model="api", max_tokens=12, temperature=1.0, top_p=0.95, **kwargs)
        return [c.text for c in done.choices]

    before = len(list(read_events(run.folder.events)))
    for _ in range(3):  # until all of them wait at once behind a long generation (a loaded machine)
        busy = client.stream(Complete(prompts=["x"], n=2, temperature=2.0, max_new_tokens=64))
        while client.status().queue:
            time.sleep(0.01)  # the long one is being generated
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = [pool.submit(ask, kwargs) for kwargs in asks]
            while client.status().queue < len(asks) and not all(a.done() for a in answers):
                time.sleep(0.01)
            together = [a.result() for a in answers]
        busy.wait()
        batches = [e["result"]["batch"] for e in list(read_events(run.folder.events))[before:]
                   if e["type"] == "command" and e["cmd"] == "complete" and e["status"] == "done"]
        if len(asks) in batches:
            break
    assert batches.count(len(asks)) == len(asks), batches  # they shared one generation
    assert together == [ask(kwargs) for kwargs in asks]


@pytest.mark.slow
def test_past_the_waiting_limit_a_request_gets_429_with_retry_after(served):
    """Requests wait for the run; past the API's limit of waiting requests (here 1) the next is
    answered 429 at once, saying when to come back. The run's processes are held still (SIGSTOP)
    while the first request waits, so nothing can answer it before the second arrives, however
    fast or slow the machine is; once they go on, the first is answered."""
    run, _, _, _ = served
    server = ApiServer(run.folder.root.parent, max_in_flight=1).start()
    slot = server.app.state.runs.slot(run.folder.root)  # the run's waiting-request limit
    auth = {"Authorization": f"Bearer {key_of(run.folder.root)}"}
    body = {"model": "api", "prompt": "sort: abc\n", "max_tokens": 4}
    try:
        os.killpg(run.pid, signal.SIGSTOP)  # the run's group (spawned in a session of its own)
        try:
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(httpx.post, f"{server.url}/completions", headers=auth, timeout=300, json=body)
                deadline = time.monotonic() + 60
                while slot._value and not waiting.done():  # noqa: SLF001 - until it holds the one slot
                    assert time.monotonic() < deadline, "the first request never took the API's slot"
                    time.sleep(0.01)
                over = httpx.post(f"{server.url}/completions", headers=auth, timeout=60, json=body)
                os.killpg(run.pid, signal.SIGCONT)
                assert waiting.result().status_code == 200, waiting.result().text
        finally:
            os.killpg(run.pid, signal.SIGCONT)
        assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
        assert int(over.headers["retry-after"]) >= 1
    finally:
        server.close()
