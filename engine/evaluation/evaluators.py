"""Evaluators: called by the trainer on every rank (collective), each returns named metrics.

Each evaluator works on its rank's share of the evaluation data and then gathers over the
data-parallel group (sums of counts, or the predictions themselves where a metric needs the
whole corpus), so every rank returns the same numbers. Under ZeRO-3 a forward or a generation
is collective, so every rank runs the same number of batches (padding its share with repeats
whose results are thrown away).

The names below are the `eval.evaluators` values; the trainer logs the results as
``eval/<metric>`` and the checkpoint callback's top-k / load-best rules monitor those names:

=============  ====================================================  =========================
evaluator      needs (evaluation rows)                               metrics
=============  ====================================================  =========================
perplexity     the tokenized evaluation set                          loss, perplexity
choice         {"input", "choices", "answer" (index or text)}        accuracy, accuracy_norm,
               or {"input", "choices", "output"}                     precision, recall, f1
exact_match    {"input", "output"} or {"messages"}                   exact_match, token_f1
generation     as exact_match; predictions saved to                  exact_match, token_f1,
               <run>/predictions/step-<n>.jsonl                      bleu, rouge1/2/L
=============  ====================================================  =========================
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from contract.config.schema import EVALUATORS, RunConfig
from contract.data_rows import preference_columns
from engine.evaluation import metrics
from engine.data.formats import encode_input_output
from engine.generation.generate import generate

Evaluator = Callable[[Any], dict[str, float]]


# -- collectives over the data-parallel group ---------------------------------------------------

def _all_reduce(values: list[float], trainer, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if trainer.env.world_size > 1:
        dist.all_reduce(t, op=op, group=trainer.env.dp_group)
    return t.tolist()


def _gather(items: list, trainer) -> list:
    """Every rank's `items`, concatenated in rank order, on every rank."""
    if trainer.env.dp_size <= 1:
        return list(items)
    parts: list = [None] * trainer.env.dp_size
    dist.all_gather_object(parts, items, group=trainer.env.dp_group)
    return [x for part in parts for x in part]


def _share(rows: list, trainer) -> list[tuple[int, Any]]:
    """This rank's (index, row) share: every dp_size-th row."""
    env = trainer.env
    return list(enumerate(rows))[env.dp_rank::env.dp_size]


def _batch_count(n: int, batch_size: int, trainer) -> int:
    """The most batches any rank needs: every rank runs that many (collective forwards)."""
    return int(_all_reduce([math.ceil(n / batch_size)], trainer, dist.ReduceOp.MAX)[0])


def _limit(rows: list, max_samples: int) -> list:
    return rows[:max_samples] if max_samples else rows


# -- perplexity -------------------------------------------------------------------------------------

class Perplexity:
    """Token-weighted mean loss over the evaluation set, and its exponential."""

    name = "perplexity"

    def __init__(self, max_samples: int = 0):
        self.max_samples = max_samples

    def __call__(self, trainer) -> dict[str, float]:
        loader = trainer.eval_loader()
        per_step = trainer.config.eval.batch_size * trainer.env.dp_size
        # eval.max_samples in whole batches of all ranks, rounded down (at least one)
        batches = max(1, self.max_samples // per_step) if self.max_samples else None
        loss_sum, tokens = 0.0, 0
        for i, batch in enumerate(loader):
            if batches is not None and i >= batches:
                break
            loss = trainer.compute_loss(batch)  # every rank forwards every batch (ZeRO-3)
            n = int((batch["labels"][:, 1:] != -100).sum())
            if n:
                loss_sum += float(loss) * n
                tokens += n
        loss_sum, tokens = _all_reduce([loss_sum, tokens], trainer)
        if tokens == 0:
            return {}
        mean = loss_sum / tokens
        return {"loss": mean, "perplexity": metrics.perplexity(loss_sum, int(tokens))}


# -- classification by the loss of each candidate answer --------------------------------------------

def choice_rows(rows: Sequence[dict]) -> list[tuple[str, list[str], int]]:
    """(input, choices, index of the right one) of every row that has "choices"; a row's answer
    is "answer" (an index or one of the choices) or else "output" (one of the choices)."""
    out = []
    for n, row in enumerate(rows):
        if not isinstance(row, dict) or "choices" not in row:
            continue
        choices = [str(c) for c in row["choices"]]
        answer = row.get("answer", row.get("output"))
        if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
            index = answer
        elif isinstance(answer, str) and answer in choices:
            index = choices.index(answer)
        else:
            raise ValueError(f"data.eval row {n + 1}: choice rows need 'answer' (an index below "
                             f"{len(choices)} or one of the choices) or 'output' (one of the choices), "
                             f"got {answer!r}")
        out.append((str(row["input"]), choices, index))
    return out


class Choice:
    """Pick the candidate whose tokens (answer + eos, encoded as training encodes an output)
    have the lowest summed loss after the input; `accuracy_norm` divides by the answer's length
    in characters first (lm-evaluation-harness's acc_norm). Precision / recall / F1 are macro
    averages over the answers' texts as classes."""

    name = "choice"

    def __init__(self, batch_size: int, max_samples: int = 0):
        self.batch_size, self.max_samples = batch_size, max_samples

    def __call__(self, trainer) -> dict[str, float]:
        rows = _limit(choice_rows(trainer.eval_rows or []), self.max_samples)
        if not rows:
            return {}
        mine = _share(rows, trainer)
        pairs = [(i, c) for i, (_, choices, _) in mine for c in range(len(choices))]
        losses = self._losses(trainer, [(rows[i][0], rows[i][1][c]) for i, c in pairs],
                              fallback=(rows[0][0], rows[0][1][0]))
        scored: dict[int, list[tuple[float, float, int]]] = {}  # row -> (loss, loss per char, choice)
        for (i, c), loss in zip(pairs, losses):
            scored.setdefault(i, []).append((loss, loss / max(len(rows[i][1][c]), 1), c))
        picked = _gather([(i, min(s)[2], min(s, key=lambda t: t[1])[2]) for i, s in scored.items()], trainer)
        truth = [rows[i][1][rows[i][2]] for i, _, _ in picked]
        chosen = [rows[i][1][c] for i, c, _ in picked]
        chosen_norm = [rows[i][1][c] for i, _, c in picked]
        return {"accuracy": metrics.accuracy(chosen, truth),
                "accuracy_norm": metrics.accuracy(chosen_norm, truth),
                **metrics.precision_recall_f1(chosen, truth, average="macro")}

    def _losses(self, trainer, pairs: list[tuple[str, str]], fallback: tuple[str, str]) -> list[float]:
        """Summed token loss of each (prompt, answer), batched; collective."""
        encoded = encode_input_output(trainer.tokenizer, pairs or [fallback])
        out: list[float] = []
        for b in range(_batch_count(len(pairs), self.batch_size, trainer)):
            chunk = encoded[b * self.batch_size:(b + 1) * self.batch_size] or encoded[:1]
            losses = _sequence_losses(trainer, chunk)
            if b * self.batch_size < len(pairs):
                out.extend(losses)
        return out[:len(pairs)]


def _sequence_losses(trainer, encoded: list[tuple[list[int], list[int]]]) -> list[float]:
    """Summed loss over the labelled tokens of each (input_ids, labels), one forward."""
    pad = trainer.tokenizer.pad_token_id or 0
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (x, y) in enumerate(encoded):
        ids[row, :len(x)], labels[row, :len(y)], mask[row, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    device = trainer.engine.device
    out = trainer.engine(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    logits = out.logits[:, -width:].float()  # prompt tuning puts its virtual tokens in front
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    target = labels[:, 1:].to(device)
    picked = logprobs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (-(picked * (target != -100))).sum(dim=1).tolist()


# -- generation ---------------------------------------------------------------------------------------

def prompt_and_reference(row: Any, tokenizer) -> tuple[str, str, bool] | None:
    """(prompt text, expected answer, whether the prompt still needs special tokens) of an
    evaluation row, or None for rows that have no answer to compare with."""
    if not isinstance(row, dict):
        return None
    if row.get("input") is not None and row.get("output") is not None:
        return str(row["input"]), str(row["output"]), True
    messages = row.get("messages")
    if isinstance(messages, list) and messages and messages[-1].get("role") == "assistant":
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        return prompt, str(messages[-1].get("content", "")), False
    columns = preference_columns(row)  # a preference row: its chosen (or desirable) answer
    if columns is not None and columns.get("label", "desirable") == "desirable":
        answer = row.get("chosen", row.get("completion"))
        if isinstance(row["prompt"], str):
            return row["prompt"], str(answer), True
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        return prompt, str(answer[-1]["content"]), False
    return None


class Generation:
    """Greedy generation from each row's prompt, scored against its answer with `metric_names`
    (see :data:`engine.evaluation.metrics.TEXT_METRICS`); with `save_predictions` rank 0 writes every
    prediction to <run folder>/predictions/step-<n>.jsonl."""

    def __init__(self, metric_names: Sequence[str], max_new_tokens: int, batch_size: int,
                 max_samples: int = 0, save_predictions: bool = False, name: str = "generation"):
        unknown = [m for m in metric_names if m not in metrics.TEXT_METRICS]
        if unknown:
            raise ValueError(f"unknown text metric(s) {unknown}; known: {', '.join(metrics.TEXT_METRICS)}")
        self.metric_names, self.max_new_tokens = list(metric_names), max_new_tokens
        self.batch_size, self.max_samples = batch_size, max_samples
        self.save_predictions, self.name = save_predictions, name

    def __call__(self, trainer) -> dict[str, float]:
        found = [prompt_and_reference(r, trainer.tokenizer) for r in trainer.eval_rows or []]
        items = _limit([f for f in found if f is not None], self.max_samples)
        if not items:
            return {}
        predictions = self._generate(trainer, items)
        references = [ref for _, ref, _ in items]
        results = metrics.text_metrics(predictions, references, self.metric_names)
        if self.save_predictions and trainer.env.rank == 0:
            self._save(trainer, items, predictions)
        return results

    def _generate(self, trainer, items: list[tuple[str, str, bool]]) -> list[str]:
        """Every item's prediction, in order, on every rank. Raw inputs (encoded with special
        tokens, as in training) and chat-rendered prompts (without) are generated apart."""
        predictions: dict[int, str] = {}
        for special in (True, False):
            kind = [(i, it[0]) for i, it in enumerate(items) if it[2] is special]
            if kind:  # every rank sees all rows, so all of them agree on this
                predictions.update(self._generate_share(trainer, kind, special))
        return [predictions[i] for i in range(len(items))]

    def _generate_share(self, trainer, prompts: list[tuple[int, str]], special: bool) -> dict[int, str]:
        """Each rank generates every dp_size-th prompt, in equal numbers of batches; gathered."""
        mine = [p for _, p in _share(prompts, trainer)]
        done: list[tuple[int, str]] = []
        for b in range(_batch_count(len(mine), self.batch_size, trainer)):
            chunk = mine[b * self.batch_size:(b + 1) * self.batch_size]
            texts = generate(trainer, [p for _, p in chunk] or [prompts[0][1]],  # idle ranks still take part
                             max_new_tokens=self.max_new_tokens, add_special_tokens=special)
            done.extend((i, t) for (i, _), t in zip(chunk, texts))
        return dict(_gather(done, trainer))

    def _save(self, trainer, items, predictions: list[str]) -> None:
        folder = trainer.folder.root / "predictions"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step-{trainer.state.global_step}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for (prompt, reference, _), prediction in zip(items, predictions):
                f.write(json.dumps({"prompt": prompt, "reference": reference, "prediction": prediction,
                                    "exact_match": metrics.exact_match([prediction], [reference])},
                                   ensure_ascii=False) + "\n")
        tmp.replace(path)  # whole file or none: a reader never sees half of it


# -- from the run config ----------------------------------------------------------------------------

# the generating evaluators and their metrics (both named: one generation pass, all metrics)
GENERATION_METRICS = {"exact_match": ("exact_match", "token_f1"),
                      "generation": ("exact_match", "token_f1", "bleu", "rouge")}
SCORING = {"perplexity": lambda e: Perplexity(e.max_samples),
           "choice": lambda e: Choice(e.batch_size, e.max_samples)}


def from_config(cfg: RunConfig) -> list[Evaluator]:
    """The evaluators `eval.evaluators` names, in order (a generating one where the first of
    exact_match / generation is named)."""
    e, names = cfg.eval, list(dict.fromkeys(cfg.eval.evaluators))
    unknown = [n for n in names if n not in EVALUATORS]
    if unknown or set(EVALUATORS) != set(SCORING) | set(GENERATION_METRICS):
        raise ValueError(f"eval.evaluators: unknown {unknown}; allowed: {', '.join(EVALUATORS)}")
    generating = [n for n in names if n in GENERATION_METRICS]
    built: list[Evaluator] = []
    for name in names:
        if name in SCORING:
            built.append(SCORING[name](e))
        elif name == generating[0]:
            wanted = dict.fromkeys(m for g in generating for m in GENERATION_METRICS[g])
            built.append(Generation(list(wanted), e.max_new_tokens, e.batch_size, e.max_samples,
                                    save_predictions="generation" in generating, name=name))
    if e.lm_eval_tasks:
        built.append(_lm_eval_tasks(cfg))
    return built


def _lm_eval_tasks(cfg: RunConfig) -> Evaluator:
    """The evaluator of eval.lm_eval_tasks (engine.evaluation.lm_eval_tasks), imported only when asked for:
    lm-evaluation-harness is an optional package."""
    try:
        from engine.evaluation.lm_eval_tasks import LmEvalTasks
    except ImportError as e:
        raise ValueError("eval.lm_eval_tasks needs lm-evaluation-harness: pip install 'lm-eval>=0.4.9' "
                         f"({e})") from None
    e = cfg.eval
    return LmEvalTasks(e.lm_eval_tasks, e.batch_size, e.max_new_tokens, e.max_samples)
