"""The live model behind the OpenAI-compatible API (supervisor.openai_api), driven by real clients
against a 2-rank ZeRO-3 run started through the real entry point: the official `openai` client
(chat and completions, streamed and not, a wrong key, an unknown model), lm-evaluation-harness's
`local-completions` model, whose log-likelihoods equal its own `hf` model's on the same weights
saved at the same step, and the run's losses, equal to those of a run that served nothing. The
same run evaluates the harness's tasks itself at its end (`eval.lm_eval_tasks`), and a chat-only
session of its checkpoint answers as transformers does from the export."""

from __future__ import annotations

import math
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from contract.protocol.completion_commands import Complete
from contract.run_folder import read_events
from control_runs import end_leftover_runs  # noqa: F401 - autouse: no run outlives its test
from control_runs import CONNECT_S, end_run, launch, logs_of, losses, task_files, wait_exit, wait_for_step
from supervisor.client import RunClient
from supervisor.openai_api import ApiServer, key_of

openai = pytest.importorskip("openai")

STEPS = 120  # the quiet twin's steps; the served run's losses over them must equal the twin's
# The served run's max_steps: never reached. It trains only while a test lets it (the first test,
# for as long as its requests take: any number of steps, on a fast CPU hundreds), is paused
# between tests, and is stopped by the last test once past STEPS (or by the fixture's teardown).
SERVED_STEPS = 100_000
TASKS = Path(__file__).parent / "lm_eval_task"
LM_EVAL_TASKS = ("choice.yaml", "generate.yaml", "loglikelihood.yaml")
SAME = ("zero_stage=3", "optim.scheduler=constant", "optim.warmup_steps=0",  # constant: max_steps
        "optim.lr=0.003", "seed=7")                                           # does not change the lr


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The served run (`api`), a quiet twin that serves nothing, and the API over both."""
    tmp = tmp_path_factory.mktemp("api")
    task = task_files(tmp / "task")
    lm_eval_tasks = []  # the served run also runs the tests' tasks in its evaluation at the end
    for name in LM_EVAL_TASKS:
        (tmp / name).write_text(yaml.safe_dump(_task(name)))
        lm_eval_tasks.append(str(tmp / name))
    run = launch(tmp, "api", task, *SAME, f"max_steps={SERVED_STEPS}", "eval.at_end=true",
                 "checkpoint.save_at_end=true", f"eval.lm_eval_tasks=[{','.join(lm_eval_tasks)}]")
    quiet = launch(tmp, "quiet", task, *SAME, f"max_steps={STEPS}", "control.enabled=false")
    server = ApiServer(tmp / "runs").start()
    client = RunClient.connect(run.folder.root, timeout=CONNECT_S)
    client.pause()  # each test resumes it where it needs training to go on
    try:
        yield types.SimpleNamespace(run=run, quiet=quiet, server=server, client=client, tmp=tmp,
                                    key=key_of(run.folder.root))
    finally:
        client.close()
        server.close()
        for r in (run, quiet):
            end_run(r, grace_s=5.0)


def _openai(served, key: str | None = None):
    return openai.OpenAI(base_url=served.server.url, api_key=key or served.key, max_retries=0, timeout=300)


@pytest.mark.slow
def test_the_openai_client_chats_and_completes_while_the_run_trains(served):
    resumed = served.client.resume()
    wait_for_step(served.run, resumed.step + 1)
    try:
        _chat_and_complete(served)
    finally:
        served.client.pause()


def _chat_and_complete(served) -> None:
    api = _openai(served)
    assert [m.id for m in api.models.list().data] == ["api"]  # the run's own key grants its run only

    chat = api.chat.completions.create(model="api", messages=[{"role": "user", "content": "reverse: abc"}],
                                       max_tokens=6, logprobs=True, top_logprobs=2)
    choice = chat.choices[0]
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 6
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) <= 2 for t in choice.logprobs.content)

    pieces = list(api.chat.completions.create(model="api", messages=[{"role": "user", "content": "sort: dcba"}],
                                              max_tokens=8, stream=True))
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length") and len(text) <= 8

    done = api.completions.create(model="api", prompt="reverse: hello\n", max_tokens=5, n=2, temperature=1.0,
                                  seed=11, logprobs=1)
    assert [c.index for c in done.choices] == [0, 1] and done.system_fingerprint.endswith("-seed-11")
    assert all(len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) <= 5 for c in done.choices)
    streamed = list(api.completions.create(model="api", prompt="sort: kernel\n", max_tokens=6, stream=True,
                                           stop=["l"]))
    streamed_text = "".join(c.choices[0].text for c in streamed)
    assert "l" not in streamed_text and streamed[-1].choices[0].finish_reason in ("stop", "length")
    plain = api.completions.create(model="api", prompt="sort: kernel\n", max_tokens=6, stop=["l"])
    assert "l" not in plain.choices[0].text

    # echo + logprobs + max_tokens 0: the prompt scored, every token but the first
    scored = api.completions.create(model="api", prompt="reverse: abc\n", max_tokens=0, echo=True, logprobs=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.endswith("reverse: abc\n") and lp.token_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:]) and len(lp.tokens) == len(lp.token_logprobs)


@pytest.mark.slow
def test_unseeded_samples_differ_and_report_the_seed_that_repeats_them(served):
    first = served.client.generate("reverse: kernel\n", temperature=1.0, max_new_tokens=12).wait()
    second = served.client.generate("reverse: kernel\n", temperature=1.0, max_new_tokens=12).wait()
    assert first.seed != second.seed and first.text != second.text
    # the run is paused (its weights stay): the reported seed gives the same sample again
    a = served.client.generate("sort: kernel\n", temperature=1.0, max_new_tokens=12).wait()
    b = served.client.generate("sort: kernel\n", temperature=1.0, max_new_tokens=12, seed=a.seed).wait()
    assert a.text == b.text and b.seed == a.seed
    api = _openai(served)  # the same through the API: a seed repeats its samples, n of them at once
    asked = dict(model="api", prompt="reverse: hello\n", max_tokens=6, n=2, temperature=1.0, seed=11)
    assert [c.text for c in api.completions.create(**asked).choices] == \
        [c.text for c in api.completions.create(**asked).choices]


@pytest.mark.slow
def test_refusals_come_in_openais_shape_with_their_status(served):
    with pytest.raises(openai.AuthenticationError):
        _openai(served, "lt-wrong").chat.completions.create(model="api", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError) as missing:
        _openai(served).completions.create(model="no-such-run", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    url, auth = served.server.url, {"Authorization": f"Bearer {served.key}"}
    bad = httpx.post(f"{url}/completions", json={"model": "api", "prompt": "x", "n": 0}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    big = httpx.post(f"{url}/completions", headers=auth, json={"model": "api", "prompt": "x" * (2 << 20)})
    assert big.status_code == 413 and "larger" in big.json()["error"]["message"]
    assert httpx.get(f"{url}/models").status_code == 401
    # the quiet run has no control server: it is not a model
    assert "quiet" not in [m.id for m in _openai(served, key_of(served.tmp / "runs")).models.list().data]


@pytest.mark.slow
def test_requests_waiting_together_share_a_generation_and_answer_as_alone(served):
    """Requests queued while the run is busy answer as the same requests one by one: greedy text
    and scores alike, a seeded sample the same (engine.generation.batch); the greedy ones of the
    same settings went through one generation (`batch` in the command's recorded result)."""
    api = _openai(served)
    asks = [dict(model="api", prompt="reverse: kernel\n", max_tokens=8, temperature=0),
            dict(model="api", messages=[{"role": "user", "content": "sort: dcba"}], max_tokens=12, temperature=0),
            dict(model="api", prompt=["sort: hello\n", "reverse: abc\n"], max_tokens=5, temperature=0, logprobs=2),
            dict(model="api", prompt="reverse: hello\n", max_tokens=6, temperature=1.0, n=2, seed=3)]

    def ask(kwargs: dict) -> list:
        if "messages" in kwargs:
            return [c.message.content for c in api.chat.completions.create(**kwargs).choices]
        return [(c.text, c.logprobs.token_logprobs if c.logprobs else None)
                for c in api.completions.create(**kwargs).choices]

    before = len(list(read_events(served.run.folder.events)))
    for _ in range(3):  # until all four wait at once behind a long generation (a loaded machine)
        busy = served.client.stream(Complete(prompts=["x"], n=16, temperature=5.0, max_new_tokens=240))
        while served.client.status().queue:
            time.sleep(0.01)  # the long one is being generated
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = [pool.submit(ask, kwargs) for kwargs in asks]
            while served.client.status().queue < len(asks) and not all(a.done() for a in answers):
                time.sleep(0.01)
            together = [a.result() for a in answers]
        busy.wait()
        batches = [e["result"]["batch"] for e in list(read_events(served.run.folder.events))[before:]
                   if e["type"] == "command" and e["cmd"] == "complete" and e["status"] == "done"]
        if 3 in batches:
            break
    assert batches.count(3) == 3, batches  # the three greedy ones shared a generation
    alone = [ask(kwargs) for kwargs in asks]
    assert [[t for t, _ in a] for a in together[:1] + together[2:]] == [[t for t, _ in a] for a in alone[:1] + alone[2:]]
    assert together[1] == alone[1]
    for (_, mine), (_, reference) in zip(together[2], alone[2]):
        assert all(math.isclose(m, r, abs_tol=1e-5) for m, r in zip(mine, reference))


def _task(name: str) -> dict:
    config = yaml.safe_load((TASKS / name).read_text())
    config["dataset_kwargs"]["data_files"]["test"] = str(TASKS / "data.jsonl")
    return config


def _evaluate(model: str, model_args: dict, names: tuple[str, ...] = ("choice.yaml", "generate.yaml")) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    return simple_evaluate(model=model, model_args=model_args, tasks=[_task(n) for n in names],
                           task_manager=TaskManager(include_defaults=False), log_samples=True, batch_size=4,
                           device="cpu")


def _responses(results: dict, task: str) -> list:
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
def test_lm_eval_through_the_api_equals_its_hf_model_on_the_saved_weights(served, monkeypatch):
    from engine.checkpoint.export import export
    held = served.client.status()  # paused: the weights stay as they are while both evaluate
    saved = served.client.save()
    exported = served.tmp / "exported"
    export(saved.checkpoint, str(exported))
    monkeypatch.setenv("OPENAI_API_KEY", served.key)
    live = _evaluate("local-completions", {"base_url": f"{served.server.url}/completions", "model": "api",
                                           "tokenizer": str(exported), "tokenizer_backend": "huggingface", "add_bos_token": True,
                                           "max_length": 256})
    hf = _evaluate("hf", {"pretrained": str(exported), "dtype": "float32"})
    served.saved, served.exported = saved, exported  # the chat session's test answers from them
    assert held.paused and served.client.status().step == saved.step == held.step
    for task in ("livetune_choice", "livetune_generate"):
        ours, theirs = _responses(live, task), _responses(hf, task)
        assert len(ours) == len(theirs) == 6
        if task == "livetune_generate":
            assert ours == theirs  # greedy generation: exactly the same text
            continue
        for mine, reference in zip(ours, theirs):
            assert [r[0][1] for r in mine] == [r[0][1] for r in reference]  # is_greedy
            assert all(math.isclose(m[0][0], r[0][0], abs_tol=1e-4) for m, r in zip(mine, reference)), \
                (mine, reference)


@pytest.mark.slow
def test_a_chat_session_of_the_checkpoint_answers_as_transformers_does_from_its_export(served):
    """`<run>@<checkpoint>`: the saved step, restored in the run's own layout (2 ranks, ZeRO-3)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from contract.run_folder import make_run_folder
    from supervisor.chat_sessions import chat_config
    from supervisor.launch import spawn
    step = served.saved.step
    config = chat_config(served.saved.checkpoint)
    session = spawn(config, make_run_folder(config), extra_env={"LIVETUNE_CACHE": str(served.tmp / "task" / "cache")})
    try:
        api = _openai(served, key_of(served.tmp / "runs"))
        name = f"api@step-{step}"
        deadline = time.monotonic() + CONNECT_S
        while name not in [m.id for m in api.models.list().data]:
            assert time.monotonic() < deadline and session.process.poll() is None, logs_of(session)
            time.sleep(0.5)
        tok = AutoTokenizer.from_pretrained(served.exported)
        model = AutoModelForCausalLM.from_pretrained(served.exported, dtype=torch.float32).eval()
        for prompt in ("reverse: kernel\n", "sort: hello\n"):
            answer = api.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0)
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
            assert answer.choices[0].text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            scored = api.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits.float(), -1)[0]
            expected = [logp[t - 1, ids[0, t]].item() for t in range(1, ids.shape[1])]
            got = scored.choices[0].logprobs.token_logprobs[1:]
            assert len(got) == len(expected) and all(math.isclose(g, e, abs_tol=1e-4) for g, e in zip(got, expected))
        RunClient(session.folder.root).stop(save=False)
        assert wait_exit(session) == 0, logs_of(session)
    finally:
        end_run(session, grace_s=5.0)


@pytest.mark.slow
def test_a_run_that_served_the_api_trained_exactly_as_one_that_did_not(served):
    served.client.resume()
    wait_for_step(served.run, STEPS, timeout=600)
    stopped = served.client.stop(save=True)  # the end of training: its evaluation, the final model
    served.client.close()
    assert stopped.final_model is True
    assert wait_exit(served.run, timeout=600) == 0, logs_of(served.run)
    assert wait_exit(served.quiet, timeout=600) == 0, logs_of(served.quiet)
    answered = [e for e in read_events(served.run.folder.events)
                if e["type"] == "command" and e["cmd"] == "complete" and e["status"] == "done"]
    assert len(answered) >= 8
    loud, quiet = losses(served.run), losses(served.quiet)
    assert sorted(quiet) == list(range(1, STEPS + 1)) and sorted(loud)[:STEPS] == sorted(quiet)
    assert {step: loud[step] for step in quiet} == quiet  # exactly: the twin's steps


@pytest.mark.slow
def test_lm_eval_tasks_in_the_runs_evaluation_equal_the_harness_on_its_saved_model(served):
    """eval.lm_eval_tasks: the harness's tasks on the live weights, evaluated at the end of the
    served run, as evaluation metrics equal to the harness's hf model on the final model saved."""
    evaluated = [e for e in read_events(served.run.folder.events) if e["type"] == "eval"][-1]
    reference = _evaluate("hf", {"pretrained": str(served.run.folder.model), "dtype": "float32"},
                          names=LM_EVAL_TASKS)["results"]
    last = max(losses(served.run))  # stopped past STEPS, at a step that depends on the CPU's speed
    assert last >= STEPS and evaluated["step"] == last and "eval/loss" in evaluated  # beside the others
    assert evaluated["eval/lm_eval/livetune_choice/acc"] == reference["livetune_choice"]["acc,none"]
    assert evaluated["eval/lm_eval/livetune_generate/exact_match"] == \
        reference["livetune_generate"]["exact_match,none"]
    assert math.isclose(evaluated["eval/lm_eval/livetune_loglikelihood/perplexity"],
                        reference["livetune_loglikelihood"]["perplexity,none"], rel_tol=1e-4)
