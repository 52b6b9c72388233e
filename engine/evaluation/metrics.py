"""Evaluation metrics on plain Python values (no model, no process group).

Accuracy, exact match, precision / recall / F1 (over class labels, and SQuAD-style over tokens
of a generated text) and perplexity are a few lines each; BLEU comes from `sacrebleu` and ROUGE
from `rouge-score`, the reference implementations people compare against. Corpus metrics (BLEU)
need the whole corpus, so the evaluators gather predictions from every rank before calling
these, and every rank computes the same numbers.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import Callable, Hashable, Sequence


def _check_pairs(predictions: Sequence, references: Sequence) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")


def accuracy(predictions: Sequence[Hashable], references: Sequence[Hashable]) -> float:
    """Fraction of predictions equal to their reference (0.0 for no samples)."""
    _check_pairs(predictions, references)
    if not predictions:
        return 0.0
    return sum(p == r for p, r in zip(predictions, references)) / len(predictions)


def normalize_answer(text: str) -> str:
    """Strip surrounding whitespace and collapse inner runs of it (case and punctuation kept:
    for the default task's `upper` operation case is the answer)."""
    return " ".join(str(text).split())


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of predictions equal to their reference after :func:`normalize_answer`."""
    _check_pairs(predictions, references)
    return accuracy([normalize_answer(p) for p in predictions], [normalize_answer(r) for r in references])


def precision_recall_f1(predictions: Sequence[Hashable], references: Sequence[Hashable],
                        average: str = "macro") -> dict[str, float]:
    """Precision, recall and F1 over class labels.

    `average` "macro": the unweighted mean over every label seen in references or predictions
    (a label never predicted has precision 0); "micro": from the pooled counts (equal to
    accuracy for single-label classification).
    """
    _check_pairs(predictions, references)
    if average not in ("macro", "micro"):
        raise ValueError(f"average must be 'macro' or 'micro', not {average!r}")
    labels = sorted(set(references) | set(predictions), key=repr)
    tp = Counter(p for p, r in zip(predictions, references) if p == r)
    predicted, actual = Counter(predictions), Counter(references)
    if average == "micro":
        return _prf(sum(tp.values()), sum(predicted.values()), sum(actual.values()))
    per_label = [_prf(tp[c], predicted[c], actual[c]) for c in labels]
    if not per_label:
        return {"precision": 0.0, "recall": 0.0, "f1": 0.0}
    return {k: sum(s[k] for s in per_label) / len(per_label) for k in ("precision", "recall", "f1")}


def _prf(true_positives: int, predicted: int, actual: int) -> dict[str, float]:
    p = true_positives / predicted if predicted else 0.0
    r = true_positives / actual if actual else 0.0
    return {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0}


_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def _tokens(text: str) -> list[str]:
    return _PUNCT.sub(" ", str(text).lower()).split()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style F1 of the bag of words (lower-cased, punctuation removed) of two texts;
    1.0 when both are empty. Texts without spaces (one word) score 0 or 1."""
    pred, ref = _tokens(prediction), _tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(ref)
    return 2 * p * r / (p + r)


def mean_token_f1(predictions: Sequence[str], references: Sequence[str]) -> float:
    _check_pairs(predictions, references)
    if not predictions:
        return 0.0
    return sum(token_f1(p, r) for p, r in zip(predictions, references)) / len(predictions)


def perplexity(loss_sum: float, tokens: int) -> float:
    """exp of the mean token loss; capped at exp(50) so that a diverged model gives a number."""
    if tokens <= 0:
        raise ValueError("perplexity needs at least one token")
    return math.exp(min(loss_sum / tokens, 50.0))


def bleu(predictions: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (0-100) by sacrebleu with its default 13a tokenisation; `references` holds
    one reference per prediction, or a list of several per prediction."""
    import sacrebleu

    _check_pairs(predictions, references)
    if not predictions:
        return 0.0
    per_sample = [[r] if isinstance(r, str) else list(r) for r in references]
    width = max(len(r) for r in per_sample)
    # sacrebleu wants reference *streams*: stream k holds every sample's k-th reference
    streams = [[refs[k] if k < len(refs) else None for refs in per_sample] for k in range(width)]
    return float(sacrebleu.corpus_bleu(list(predictions), streams).score)


ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def rouge(predictions: Sequence[str], references: Sequence[str],
          rouge_types: Sequence[str] = ROUGE_TYPES) -> dict[str, float]:
    """Mean ROUGE F-measures (0-1) by Google's rouge-score, with its Porter stemmer."""
    from rouge_score import rouge_scorer

    _check_pairs(predictions, references)
    if not predictions:
        return {t: 0.0 for t in rouge_types}
    scorer = rouge_scorer.RougeScorer(list(rouge_types), use_stemmer=True)
    totals = dict.fromkeys(rouge_types, 0.0)
    for pred, ref in zip(predictions, references):
        scores = scorer.score(ref, pred)  # rouge-score takes (target, prediction)
        for t in rouge_types:
            totals[t] += scores[t].fmeasure
    return {t: v / len(predictions) for t, v in totals.items()}


# name -> function of (predictions, references) giving flat named numbers
TEXT_METRICS: dict[str, Callable[[Sequence[str], Sequence[str]], dict[str, float]]] = {
    "exact_match": lambda p, r: {"exact_match": exact_match(p, r)},
    "token_f1": lambda p, r: {"token_f1": mean_token_f1(p, r)},
    "bleu": lambda p, r: {"bleu": bleu(p, r)},
    "rouge": rouge,
}


def text_metrics(predictions: Sequence[str], references: Sequence[str],
                 names: Sequence[str] = tuple(TEXT_METRICS)) -> dict[str, float]:
    """The named metrics of generated answers, flat: exact_match, token_f1, bleu and
    rouge1 / rouge2 / rougeL (for "rouge")."""
    unknown = [n for n in names if n not in TEXT_METRICS]
    if unknown:
        raise ValueError(f"unknown text metric(s) {unknown}; known: {', '.join(TEXT_METRICS)}")
    out: dict[str, float] = {}
    for name in names:
        out.update(TEXT_METRICS[name](predictions, references))
    return out
