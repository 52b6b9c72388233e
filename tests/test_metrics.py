"""Each metric against values worked out by hand on small cases."""

import math

import pytest

from engine.evaluation import metrics


def test_accuracy_and_exact_match():
    assert metrics.accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    assert metrics.accuracy([], []) == 0.0
    # whitespace around and inside is normalised, case is not (the `upper` task depends on it)
    assert metrics.exact_match([" abc\n", "a  b", "ABC"], ["abc", "a b", "abc"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        metrics.accuracy([1, 2], [1])


def test_precision_recall_f1_macro_and_micro():
    preds, refs = ["a", "a", "b"], ["a", "b", "b"]
    # label a: tp 1 of 2 predicted, 1 actual -> P 1/2, R 1, F 2/3
    # label b: tp 1 of 1 predicted, 2 actual -> P 1, R 1/2, F 2/3
    macro = metrics.precision_recall_f1(preds, refs)
    assert macro == pytest.approx({"precision": 0.75, "recall": 0.75, "f1": 2 / 3})
    micro = metrics.precision_recall_f1(preds, refs, average="micro")
    assert micro == pytest.approx({"precision": 2 / 3, "recall": 2 / 3, "f1": 2 / 3})
    # a label only ever predicted (c) counts with recall 0 / precision 0
    p = metrics.precision_recall_f1(["a", "c"], ["a", "a"])
    # a: tp 1, predicted 1, actual 2 -> P 1, R 1/2, F 2/3; c: P 0, R 0, F 0
    assert p == pytest.approx({"precision": 0.5, "recall": 0.25, "f1": 1 / 3})
    with pytest.raises(ValueError, match="average"):
        metrics.precision_recall_f1(preds, refs, average="weighted")


def test_token_f1():
    # common 3 words; precision 3/3, recall 3/4 -> F 6/7
    assert metrics.token_f1("The cat sat.", "the cat sat down") == pytest.approx(6 / 7)
    assert metrics.token_f1("abc", "abd") == 0.0
    assert metrics.token_f1("", "") == 1.0
    assert metrics.mean_token_f1(["abc", "x y"], ["abc", "y z"]) == pytest.approx((1 + 0.5) / 2)


def test_perplexity():
    assert metrics.perplexity(3 * math.log(2), 3) == pytest.approx(2.0)
    assert metrics.perplexity(1e6, 1) == pytest.approx(math.exp(50))  # capped, still a number
    with pytest.raises(ValueError):
        metrics.perplexity(1.0, 0)


def test_bleu_by_hand():
    assert metrics.bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(100.0)
    # n-gram precisions 4/5, 3/4, 2/3, 1/2, same length: 100 * (0.8 * 0.75 * 2/3 * 0.5) ** (1/4)
    assert metrics.bleu(["a b c d e"], ["a b c d f"]) == pytest.approx(100 * 0.2 ** 0.25, rel=1e-6)
    # every n-gram right but 4 words for 6: brevity penalty exp(1 - 6/4)
    assert metrics.bleu(["a b c d"], ["a b c d e f"]) == pytest.approx(100 * math.exp(-0.5), rel=1e-6)
    # no 4-gram match: sacrebleu's default "exp" smoothing counts it as 1 / (2 * 1)
    expected = 100 * (0.75 * (2 / 3) * 0.5 * 0.5) ** 0.25
    assert metrics.bleu(["a b c d"], ["a b c e"]) == pytest.approx(expected, rel=1e-6)
    # several references per sample: the second one matches exactly
    assert metrics.bleu(["a b c d"], [["x y z w", "a b c d"]]) == pytest.approx(100.0)


def test_rouge_by_hand():
    r = metrics.rouge(["the cat sat"], ["the cat sat down"])
    # unigrams: P 3/3, R 3/4 -> 6/7; bigrams: 2 of 2 vs 2 of 3 -> 4/5; LCS 3 -> 6/7
    assert r == pytest.approx({"rouge1": 6 / 7, "rouge2": 0.8, "rougeL": 6 / 7})
    assert metrics.rouge(["a b", "c"], ["a b", "d"])["rouge1"] == pytest.approx(0.5)


def test_text_metrics_names():
    out = metrics.text_metrics(["a b c d e"], ["a b c d f"])
    assert set(out) == {"exact_match", "token_f1", "bleu", "rouge1", "rouge2", "rougeL"}
    assert out["token_f1"] == pytest.approx(0.8) and out["exact_match"] == 0.0
    assert metrics.text_metrics(["x"], ["x"], ["exact_match"]) == {"exact_match": 1.0}
    with pytest.raises(ValueError, match="unknown text metric"):
        metrics.text_metrics(["x"], ["x"], ["meteor"])
