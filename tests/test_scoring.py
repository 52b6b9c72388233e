"""Token log-probabilities (engine.generation.scoring) and the ids a generation hands back, in one process:
the data-parallel forward and the pipeline's stage path give the scores of a plain Hugging Face
forward pass, for rows of different lengths in one batch, and leave train mode and the RNG as
they were."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import make_tiny_tokenizer
from test_pp import build_pair, one_process_group  # noqa: F401 - the fixture: a one-rank gloo group


def _run(layout, module, engine, tok):
    env = types.SimpleNamespace(rank=0, world_size=1)
    return types.SimpleNamespace(layout=layout, engine=engine, tokenizer=tok, env=env,
                                 config=types.SimpleNamespace(parallel=types.SimpleNamespace(zero_stage=0)))


def _reference(model, row: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([row])).logits.float(), -1)[0]
    return [logp[t - 1, row[t]].item() for t in range(1, len(row))]


@pytest.mark.parametrize("layout", ["data-parallel", "pipeline"])
def test_scores_equal_a_plain_forward_and_leave_no_trace(one_process_group, layout):
    from engine.parallel.layouts import DataParallel, Pipeline
    from engine.generation.scoring import score
    tok = make_tiny_tokenizer()
    whole, pipe = build_pair("llama", tok)
    env = types.SimpleNamespace(rank=0, world_size=1)
    if layout == "pipeline":
        run = _run(Pipeline(env), pipe.module, pipe, tok)
    else:
        run = _run(DataParallel(env), whole, types.SimpleNamespace(module=whole, device=torch.device("cpu")), tok)
    run.engine.module.train()
    rows = [tok("reverse: kcodw\n")["input_ids"], tok("ab")["input_ids"], [5, 9, 7, 11, 12, 13, 14]]
    torch.manual_seed(3)
    before = torch.get_rng_state()
    scores = score(run, rows, top=3)
    assert torch.equal(torch.get_rng_state(), before) and run.engine.module.training
    for row, got in zip(rows, scores):
        want = _reference(whole.eval(), row)
        assert got.logprobs[0] is None and len(got.logprobs) == len(row)
        assert max(abs(g - w) for g, w in zip(got.logprobs[1:], want)) < 1e-5
        # the best alternative is at least as likely as the token that is there
        assert all(top[0][1] >= lp - 1e-6 and len(top) == 3 for top, lp in zip(got.top[1:], got.logprobs[1:]))
    with torch.no_grad():
        last = torch.log_softmax(whole(torch.tensor([rows[0]])).logits[0, -1].float(), -1)
    assert scores[0].next_top[0][0] == int(last.argmax())


def test_generation_hands_back_the_ids_its_text_was_decoded_from(one_process_group):
    from engine.generation.pipeline import pipeline_generate
    tok = make_tiny_tokenizer()
    _, pipe = build_pair("llama", tok)
    trainer = types.SimpleNamespace(engine=pipe, tokenizer=tok)
    heard: list[list[list[int]]] = []
    prompts = [tok("reverse: kcodw\n")["input_ids"], tok("ab")["input_ids"]]  # token-id prompts
    texts = pipeline_generate(trainer, prompts, max_new_tokens=6, temperature=1.0, seed=2, on_ids=heard.append)
    assert [tok.decode(ids, skip_special_tokens=True) for ids in heard[0]] == texts
    assert all(0 < len(ids) <= 6 for ids in heard[0])
