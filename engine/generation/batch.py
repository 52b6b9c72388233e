"""Several requests answered by one generation (the OpenAI-compatible API's `complete` commands
that wait at the same step boundary: engine.control.completions).

The requests' rows are left-padded into one batch and generated together by Hugging Face's
`generate` (the data-parallel and tensor-parallel layouts; under ZeRO-3 with `synced_gpus`, as
engine.generation.generate does). What may differ between the requests of one batch:

- `max_new_tokens`: each row stops at its own limit (a stopping criterion per row; the batch ends
  when every row has), and its new tokens are cut there;
- `seed`: each request samples from its own `torch.Generator`, seeded with its seed, drawing for
  its own rows only, so a request's sample does not depend on what else was in the batch: the seed
  it reports repeats it, alone or batched. (Transformers' sampler draws from the one global
  generator for the whole batch; here the sampling is a logits processor that picks each row's
  token and leaves `generate` greedy, which then takes exactly that token.)

Temperature, top-p, top-k, repetition penalty and stop strings are the batch's (the caller groups
requests that share them). Greedy rows equal the request answered alone up to the float rounding
of a different batch shape (left padding is masked, positions count the real tokens). Every RNG is
restored afterwards (engine.generation.generate.model_generate), so training does not move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from engine.context import RunContext
from engine.generation.generate import CallbackStreamer, end_ids, model_generate, new_tokens, pad_id, pad_ids
from engine.generation.pipeline import logits_processors


@dataclass
class Request:
    """One request's place in a batch: its rows (consecutive), their limit, its seed, and where its
    text streams (single-row requests only)."""
    rows: list[list[int]]
    max_new_tokens: int
    seed: int
    on_text: Callable[[str], None] | None = None


class RequestSampling(LogitsProcessor):
    """Samples each request's rows with that request's own generator and forces the token drawn
    (every other token gets -inf), so the greedy step that follows takes it."""

    def __init__(self, spans: list[tuple[int, int]], seeds: list[int], device: torch.device):
        self.spans = spans
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(scores.float(), dim=-1)
        chosen = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
        for (start, end), generator in zip(self.spans, self.generators):
            chosen[start:end] = torch.multinomial(probs[start:end], 1, generator=generator).squeeze(1)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, chosen[:, None], 0.0)


class RowLimits(StoppingCriteria):
    """A row is done once it has its own `max_new_tokens` new tokens."""

    def __init__(self, prompt_len: int, limits: list[int], device: torch.device):
        self.prompt_len = prompt_len
        self.limits = torch.tensor(limits, device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return (input_ids.shape[1] - self.prompt_len) >= self.limits


class RowsStreamer(BaseStreamer):
    """Streams the rows that asked for it, each through its own CallbackStreamer, until the row
    ends (its end token or its limit); the padding of a finished row is not streamed."""

    def __init__(self, tokenizer, streams: dict[int, tuple[Callable[[str], None], int]]):
        self.ends = end_ids(tokenizer)
        self.rows = {row: [CallbackStreamer(tokenizer, on_text, 0), limit, 0] for row, (on_text, limit) in streams.items()}
        for streamer, _, _ in self.rows.values():
            streamer.first = False  # this class skips the prompt itself
        self.first = True

    def put(self, value: torch.Tensor) -> None:
        if self.first:  # generate() first hands over the prompt
            self.first = False
            return
        tokens = value.reshape(-1).tolist()
        for row, state in self.rows.items():
            streamer, limit, count = state
            if count >= limit:
                continue
            streamer.put(torch.tensor([tokens[row]]))
            state[2] = limit if tokens[row] in self.ends else count + 1

    def end(self) -> None:
        for streamer, _, _ in self.rows.values():
            streamer.end()


def generate_requests(run: RunContext, requests: list[Request], *, temperature: float = 0.0, top_p: float = 1.0,
                      top_k: int = 0, repetition_penalty: float = 1.0,
                      stop: list[str] | None = None) -> list[list[list[int]]]:
    """The new token ids of every row of every request (each request's list in its rows' order),
    generated in one batch (collective: every rank calls it with the same requests). A row's ids
    end at its end token (kept) or its limit; stop strings are cut by the caller (the text)."""
    tok, device = run.tokenizer, run.engine.device
    rows = [r for q in requests for r in q.rows]
    limits = [q.max_new_tokens for q in requests for _ in q.rows]
    inputs = pad_ids(rows, pad_id(tok), device, left=True)
    width = inputs["input_ids"].shape[1]
    processors = logits_processors(temperature, top_p, top_k, repetition_penalty)
    if temperature > 0:
        spans, at = [], 0
        for q in requests:
            spans.append((at, at + len(q.rows)))
            at += len(q.rows)
        processors.append(RequestSampling(spans, [q.seed for q in requests], device))
    kwargs = dict(max_new_tokens=max(limits), do_sample=False, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, logits_processor=LogitsProcessorList(processors),
                  stopping_criteria=StoppingCriteriaList([RowLimits(width, limits, device)]))
    if stop:
        kwargs.update(stop_strings=stop, tokenizer=tok)
    streams, at = {}, 0
    for q in requests:
        if q.on_text is not None and len(q.rows) == 1:
            streams[at] = (q.on_text, q.max_new_tokens)
        at += len(q.rows)
    if streams:
        kwargs["streamer"] = RowsStreamer(tok, streams)
    out = model_generate(run, inputs, kwargs)
    new = [new_tokens(row[:limit], tok) for row, limit in zip(out[:, width:].tolist(), limits)]
    answers, at = [], 0
    for q in requests:
        answers.append(new[at:at + len(q.rows)])
        at += len(q.rows)
    return answers
