"""Several requests in one generation (engine.generation.batch), in one process on a tiny model:
each request's rows come out as they do when it is generated alone (its own limit, its own seed),
greedy rows as Hugging Face's own generate answers each prompt, and a streamed row streams its
text. The 2-rank ZeRO-3 run through the API: tests/test_openai_api.py."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import make_tiny_tokenizer
from test_pp import build_pair, one_process_group  # noqa: F401 - the fixture: a one-rank gloo group


def _run(model, tok):
    return types.SimpleNamespace(engine=types.SimpleNamespace(module=model, device=torch.device("cpu")),
                                 tokenizer=tok, env=types.SimpleNamespace(rank=0, world_size=1),
                                 config=types.SimpleNamespace(parallel=types.SimpleNamespace(zero_stage=0)))


def _prompts(tok) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in ("reverse: kcodw\n", "ab", "sort: hello world\n")]


def test_a_batch_answers_each_request_as_it_is_answered_alone(one_process_group):
    from engine.generation.batch import Request, generate_requests
    tok = make_tiny_tokenizer()
    whole, _ = build_pair("llama", tok)
    run = _run(whole, tok)
    whole.train()
    before = torch.get_rng_state()
    prompts = _prompts(tok)
    for sampling in ({"temperature": 0.0}, {"temperature": 1.3, "top_p": 0.9}):
        requests = [Request([prompts[0]], 7, seed=5), Request([prompts[1], prompts[1]], 3, seed=9),
                    Request([prompts[2]], 12, seed=5)]
        together = generate_requests(run, requests, **sampling)
        alone = [generate_requests(run, [r], **sampling)[0] for r in requests]
        assert together == alone, sampling
        assert [len(rows) for rows in together] == [1, 2, 1]
        assert all(len(ids) <= r.max_new_tokens for r, rows in zip(requests, together) for ids in rows)
    assert torch.equal(torch.get_rng_state(), before) and whole.training
    # greedy: what transformers' generate gives each prompt alone
    for prompt, rows in zip(prompts, generate_requests(run, [Request([p], 6, 0) for p in prompts])):
        with torch.no_grad():
            out = whole.eval().generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                        pad_token_id=tok.pad_token_id)
        assert rows[0] == out[0, len(prompt):].tolist()[:len(rows[0])]


def test_a_seed_repeats_its_sample_and_another_seed_differs(one_process_group):
    from engine.generation.batch import Request, generate_requests
    tok = make_tiny_tokenizer()
    whole, _ = build_pair("llama", tok)
    run = _run(whole, tok)
    prompt = _prompts(tok)[0]
    first = generate_requests(run, [Request([prompt, prompt], 16, seed=1)], temperature=1.0)[0]
    again = generate_requests(run, [Request([prompt], 4, seed=2), Request([prompt, prompt], 16, seed=1)],
                              temperature=1.0)[1]
    other = generate_requests(run, [Request([prompt, prompt], 16, seed=3)], temperature=1.0)[0]
    assert first == again and first != other and first[0] != first[1]


def test_a_streamed_row_streams_its_own_text(one_process_group):
    from engine.generation.batch import Request, generate_requests
    tok = make_tiny_tokenizer()
    whole, _ = build_pair("llama", tok)
    run = _run(whole, tok)
    heard: list[str] = []
    prompts = _prompts(tok)
    answers = generate_requests(run, [Request([prompts[0]], 10, 4), Request([prompts[1]], 5, 4, heard.append)],
                                temperature=1.0)
    assert "".join(heard) == tok.decode(answers[1][0], skip_special_tokens=True) and heard


@pytest.mark.parametrize("layout", ["data-parallel", "pipeline"])
def test_requests_answered_together_equal_each_answered_alone(one_process_group, layout):
    """engine.control.completions.complete_many on both kinds of layout: greedy requests of
    different lengths, a seeded sample, a scored prompt and a one-token log-likelihood request
    answered together give each one's answer alone (under pipeline parallelism the generations
    run one by one, the scoring passes together); a refused request refuses only itself."""
    from contract.protocol.completion_commands import Complete
    from engine.control.completions import CompletionRefused, complete_many
    from engine.control.pending import NO_REPLY
    from engine.control.settings import LiveSettings
    from engine.parallel.layouts import DataParallel, Pipeline
    tok = make_tiny_tokenizer()
    whole, pipe = build_pair("llama", tok)
    env = types.SimpleNamespace(rank=0, world_size=1)
    ctx = _run(whole, tok) if layout == "data-parallel" else _run(pipe.module, tok)
    ctx.engine = ctx.engine if layout == "data-parallel" else pipe
    ctx.layout = DataParallel(env) if layout == "data-parallel" else Pipeline(env)
    trainer = types.SimpleNamespace(tokenizer=tok, engine=ctx.engine, ctx=ctx,
                                    state=types.SimpleNamespace(global_step=3))
    control = types.SimpleNamespace(trainer=trainer, settings=LiveSettings(), rank=0, world_size=1)
    asked = [Complete(prompts=["reverse: kcodw\n"], max_new_tokens=7, temperature=0),
             Complete(prompts=["ab", "sort: hello\n"], max_new_tokens=3, temperature=0, logprobs=True, top_logprobs=2),
             Complete(prompts=["sort: dcba\n"], max_new_tokens=5, temperature=1.0, n=2, seed=4),
             Complete(prompts=["reverse: abc\n"], max_new_tokens=0, echo=True, logprobs=True),
             Complete(prompts=[[5, 9, 7, 11]], max_new_tokens=1, temperature=0, logprobs=True, echo=True),
             Complete(prompts=[[len(tok) + 5]], max_new_tokens=2)]
    together = complete_many(control, [(c, NO_REPLY) for c in asked])
    alone = [complete_many(control, [(c, NO_REPLY)])[0] for c in asked]
    assert isinstance(together[-1], CompletionRefused) and isinstance(alone[-1], CompletionRefused)
    for mine, reference in zip(together[:-1], alone[:-1]):
        assert [c["text"] for c in mine["choices"]] == [c["text"] for c in reference["choices"]]
        assert [c["token_ids"] for c in mine["choices"]] == [c["token_ids"] for c in reference["choices"]]
        for a, b in zip(mine["choices"], reference["choices"]):
            if a["logprobs"] is not None:
                assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
                assert all(x == y or abs(x - y) < 1e-5 for x, y in
                           zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]))
    shared = 2 if layout == "data-parallel" else 1  # the two greedy generations
    assert [r["batch"] for r in together[:-1]] == [shared, shared, 1, 1, 1]
