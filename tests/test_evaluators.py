"""Evaluators: row parsing and the config's names here; on the default task (2 ranks, ZeRO-3,
our Trainer) every evaluator gives the same numbers on every rank, equal to a one-sample-at-a-
time computation with a plain copy of the model, and the predictions land in the run folder."""

import pytest

from dist_utils import SCRIPTS, parse_results, run_deepspeed
from engine.evaluation import evaluators
from contract.config.schema import ConfigError, EVALUATORS
from contract.config.load import load_config


def test_choice_rows_take_an_index_a_text_or_the_output():
    rows = [{"input": "q1", "choices": ["a", "b"], "answer": 1},
            {"input": "q2", "choices": ["a", "b"], "answer": "a"},
            {"input": "q3", "choices": ["x", "y", "z"], "output": "z"},
            {"input": "plain", "output": "no choices here"}]
    assert evaluators.choice_rows(rows) == [("q1", ["a", "b"], 1), ("q2", ["a", "b"], 0), ("q3", ["x", "y", "z"], 2)]
    with pytest.raises(ValueError, match="row 1"):
        evaluators.choice_rows([{"input": "q", "choices": ["a"], "answer": 3}])


def test_prompt_and_reference_of_rows(tiny_tokenizer):
    assert evaluators.prompt_and_reference({"input": "q\n", "output": "a"}, tiny_tokenizer) == ("q\n", "a", True)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    prompt, ref, special = evaluators.prompt_and_reference(chat, tiny_tokenizer)
    assert ref == "hello" and not special and prompt.endswith("<|assistant|>\n") and "hi" in prompt
    assert evaluators.prompt_and_reference({"text": "just text"}, tiny_tokenizer) is None


def test_from_config_builds_the_named_evaluators_once():
    cfg = load_config(overrides=["eval.evaluators=[choice,exact_match,perplexity,generation]"])
    built = evaluators.from_config(cfg)
    assert [type(e).__name__ for e in built] == ["Choice", "Generation", "Perplexity"]
    generation = built[1]  # exact_match and generation share one generation pass
    assert generation.save_predictions and generation.metric_names == ["exact_match", "token_f1", "bleu", "rouge"]
    only_em = evaluators.from_config(load_config(overrides=["eval.evaluators=[exact_match]"]))[0]
    assert not only_em.save_predictions and only_em.metric_names == ["exact_match", "token_f1"]
    assert set(EVALUATORS) == set(evaluators.SCORING) | set(evaluators.GENERATION_METRICS)
    with pytest.raises(ConfigError, match="eval.evaluators"):
        load_config(overrides=["eval.evaluators=[perplexity,bleu]"])


@pytest.mark.slow
def test_evaluators_on_the_default_task_two_ranks_zero3(tmp_path):
    proc = run_deepspeed(SCRIPTS / "eval_check.py", nproc=2, args=("--zero", "3", "--out", str(tmp_path)),
                         timeout=1200)
    r0, r1 = sorted(parse_results(proc), key=lambda r: r["rank"])
    assert r0["results"] == r1["results"]  # every rank returns the same numbers
    got, ref = r0["results"], r0["reference"]
    expected = {"loss", "perplexity", "accuracy", "accuracy_norm", "precision", "recall", "f1",
                "exact_match", "token_f1", "bleu", "rouge1", "rouge2", "rougeL"}
    assert set(got) == expected
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)  # all 21 rows, each counted once
    assert got["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)
    assert got["accuracy"] == pytest.approx(ref["accuracy"])
    assert r0["n_predictions"] == 21 and r0["predictions_match"], r0["mismatches"]
    (event,) = r0["eval_events"]
    assert event["eval/loss"] == got["loss"] and event["eval/exact_match"] == got["exact_match"]
    assert event["eval/bleu"] == got["bleu"]
