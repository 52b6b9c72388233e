"""Token log-probabilities of whole sequences under the live weights (collective).

What the OpenAI-compatible API's `logprobs` and `echo` ask for, and how lm-evaluation-harness
scores a log-likelihood: one forward pass over the rows (right-padded, so every real token keeps
its plain position, as lm-evaluation-harness's own `hf` model feeds them), `log_softmax` of the
logits in float32, and for every position the log-probability of the token that is there and the
`top` most likely tokens. Every rank calls `score` with the same rows (the control plane
broadcasts the command): under ZeRO-3 the ranks gather each layer together; under pipeline
parallelism the stages pass the hidden states along and the last stage's summary is broadcast
(the layout's `logit_summary`). Dropout is off, train mode and every RNG are restored: the
training trajectory does not move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.context import RunContext
from engine.generation.generate import pad_id, pad_ids
from engine.parallel.pipeline import broadcast_from_last_stage, stage_forward
from engine.rng import preserved_rng

Summarize = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class RowScores:
    """One row's scores. `logprobs[i]`: log P(token i | tokens before it), None for the first;
    `top[i]`: the most likely (id, log-probability) pairs where token i was predicted ([] for the
    first); `next_top`: the same after the last token (what greedy decoding would add)."""
    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]]]
    next_top: list[tuple[int, float]]


def summary_of(ids: torch.Tensor, k: int) -> Summarize:
    """The function that turns logits [rows, L, vocab] into the summary [rows, L + 1, 1 + 2k]:
    at position t (1..L) the log-probability of token t (position L: none, 0), the ids and the
    log-probabilities of the k most likely tokens predicted from position t - 1."""
    def summarize(logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)
        rows, length = ids.shape
        out = torch.zeros(rows, length + 1, 1 + 2 * k, dtype=torch.float64, device=logits.device)
        out[:, 1:length, 0] = logp[:, :-1].gather(-1, ids[:, 1:, None].to(logits.device))[..., 0].double()
        values, indices = logp.topk(k, dim=-1)
        out[:, 1:, 1:1 + k] = indices.double()
        out[:, 1:, 1 + k:] = values.double()
        return out
    return summarize


def forward_summary(run: RunContext, inputs: dict[str, torch.Tensor], summarize: Summarize) -> torch.Tensor:
    """The summary of one forward pass of a model every rank holds whole or in shards."""
    model = run.engine.module
    was_training = model.training
    with preserved_rng(), torch.no_grad():
        model.eval()
        try:
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        finally:
            model.train(was_training)
    return summarize(logits)


def pipeline_summary(run: RunContext, inputs: dict[str, torch.Tensor], summarize: Summarize,
                     shape: tuple[int, ...]) -> torch.Tensor:
    """The summary under pipeline parallelism: the stages run the rows in turn, the last one
    summarizes its logits and sends the summary to every stage of its pipeline."""
    engine = run.engine
    module = engine.module
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    was_training = module.training
    with preserved_rng(), torch.no_grad():
        module.eval()
        try:
            logits = stage_forward(engine, (ids, mask, positions))
        finally:
            module.train(was_training)
    out = summarize(logits) if logits is not None else torch.zeros(shape, dtype=torch.float64, device=ids.device)
    return broadcast_from_last_stage(engine, out)


def score(run: RunContext, rows: list[list[int]], top: int = 1) -> list[RowScores]:
    """Each row's token log-probabilities and its `top` (at least 1) alternatives (collective)."""
    k = max(1, top)
    inputs = pad_ids(rows, pad_id(run.tokenizer), run.engine.device, left=False)
    ids = inputs["input_ids"]
    shape = (ids.shape[0], ids.shape[1] + 1, 1 + 2 * k)
    summary = run.layout.logit_summary(run, inputs, summary_of(ids, k), shape).cpu()
    return [_row(summary[r], row, k) for r, row in enumerate(rows)]


def _row(summary: torch.Tensor, row: list[int], k: int) -> RowScores:
    n = len(row)

    def top_at(t: int) -> list[tuple[int, float]]:
        return [(int(summary[t, 1 + j]), float(summary[t, 1 + k + j])) for j in range(k)]

    return RowScores(tokens=list(row), logprobs=[None] + [float(summary[t, 0]) for t in range(1, n)],
                     top=[[]] + [top_at(t) for t in range(1, n)], next_top=top_at(n))
