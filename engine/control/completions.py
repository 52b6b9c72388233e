"""The `complete` command's handler (contract.protocol.completion_commands.Complete): completions with
token log-probabilities, for the OpenAI-compatible API (supervisor.openai_api).

Run by every rank at a step boundary, like `generate`. Every prompt becomes token ids first (text
with the tokenizer's special tokens, as `generate` prompts get their BOS; a chat through the
model's chat template; ids as given), so all samples of all prompts are generated in one batch
(`n` rows per prompt). Log-probabilities come from one more forward pass over prompt + sampled
tokens (engine.generation.scoring): the model's own distribution, before temperature or top-p. `echo` with
`max_new_tokens: 0` scores the prompt only; greedy with one new token (lm-evaluation-harness's
log-likelihood request) takes that token from the same pass. Nothing here touches the run's RNG
streams or train mode (engine.generation.generate, engine.generation.scoring restore them).

Several requests waiting at the same boundary (`complete_many`, from the control plane) are
answered together: those with the same temperature, top-p, top-k, repetition penalty and stop
strings share one generation (engine.generation.batch: each row keeps its own `max_new_tokens`,
each request samples from its own seed, so its reported seed repeats its sample alone or batched),
at most BATCH_ROWS rows at once; all their log-probabilities come from one scoring pass. Under
pipeline parallelism each request still generates alone: the stages' token loop
(engine.generation.pipeline) samples from the one global generator and stops every row at one limit,
and teaching it per-request seeds and limits is more than the few requests that meet at a
boundary gain there; its scoring passes are batched as everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from contract.capabilities import Layout
from contract.protocol.completion_commands import Complete
from engine.generation.batch import Request, generate_requests
from engine.control.limits import context_tokens
from engine.control.pending import Reply
from engine.control.run import Plane
from engine.generation.generate import end_ids, fresh_seed, generate, new_tokens
from engine.generation.scoring import RowScores, score

BATCH_ROWS = 64  # rows generated together at most (a request with more rows still runs whole)


class CompletionRefused(RuntimeError):
    """The request cannot be answered (the same on every rank); nothing was changed."""


@dataclass
class Job:
    """One request on its way: its settings, its prompts and rows (`n` per prompt), then its new
    tokens and texts, their scores, and how many requests shared its generation."""
    cmd: Complete
    reply: Reply
    params: dict[str, Any]
    prompts: list[list[int]]
    rows: list[list[int]]
    new: list[list[int]] | None = None
    texts: list[str] | None = None
    scores: list[RowScores] | None = None
    batch: int = 1


def complete(control: Plane, cmd: Complete, reply: Reply) -> dict:
    """Answer `cmd`: every choice's text, finish reason, token ids and (with `logprobs`) scores."""
    outcome = complete_many(control, [(cmd, reply)])[0]
    if isinstance(outcome, CompletionRefused):
        raise outcome
    return outcome


def complete_many(control: Plane, asked: list[tuple[Complete, Reply]]) -> list[dict | CompletionRefused]:
    """Answer several requests that met at one boundary, batched where they allow (collective:
    every rank calls it with the same requests). Each gets its answer or its refusal."""
    outcomes: list[Job | CompletionRefused] = []
    for cmd, reply in asked:
        try:
            outcomes.append(_prepare(control, cmd, reply))
        except CompletionRefused as e:
            outcomes.append(e)
    jobs = [j for j in outcomes if isinstance(j, Job)]
    for group in _groups(control, jobs):
        _sample(control, group)
    _score(control, [j for j in jobs if j.cmd.logprobs])
    return [_answer(control, j) if isinstance(j, Job) else j for j in outcomes]


def _prepare(control: Plane, cmd: Complete, reply: Reply) -> Job:
    trainer = control.trainer
    tok = trainer.tokenizer
    params = control.settings.generation_params(cmd.sampling())
    if params["seed"] is None:  # drawn before anything can refuse: every rank draws alike
        params["seed"] = fresh_seed()
    prompts = prompt_ids(tok, cmd)
    room = context_tokens(trainer.engine.module, tok) - max(len(p) for p in prompts)
    if room < (1 if params["max_new_tokens"] else 0):
        raise CompletionRefused(f"complete: the prompt fills the model's context of "
                                f"{context_tokens(trainer.engine.module, tok)} tokens; shorten it")
    params["max_new_tokens"] = min(params["max_new_tokens"], room)
    return Job(cmd, reply, params, prompts, [p for p in prompts for _ in range(cmd.n)])


def _answer(control: Plane, job: Job) -> dict:
    tok, params, cmd = control.trainer.tokenizer, job.params, job.cmd
    new, texts = job.new or [], job.texts or []
    choices = [_choice(tok, i, job.rows[i], new[i], texts[i], params, cmd,
                       job.scores[i] if job.scores is not None else None) for i in range(len(job.rows))]
    return {"step": control.trainer.state.global_step, "seed": params["seed"], "model": "current",
            "choices": choices, "batch": job.batch,
            "usage": {"prompt_tokens": sum(len(p) for p in job.prompts),
                      "completion_tokens": sum(len(n) for n in new)}}


def prompt_ids(tokenizer, cmd: Complete) -> list[list[int]]:
    """Each prompt as the token ids the model continues."""
    if cmd.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise CompletionRefused("complete: this model's tokenizer has no chat template; send `prompts`")
        text = tokenizer.apply_chat_template(cmd.messages, tokenize=False, add_generation_prompt=True)
        return [tokenizer(text, add_special_tokens=False)["input_ids"]]
    out = []
    for p in cmd.prompts or []:
        ids = tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else list(p)
        if any(t >= len(tokenizer) for t in ids):
            raise CompletionRefused(f"complete: a prompt holds a token id >= the vocabulary size {len(tokenizer)}")
        out.append(ids)
    return out


# -- which requests share a generation --------------------------------------------------------------
def _kind(job: Job) -> tuple:
    """Requests of one kind can share a pass: scoring only, one greedy token read off the scoring
    pass, or a generation with these sampling settings."""
    p = job.params
    if p["max_new_tokens"] == 0:
        return ("scored",)
    if p["max_new_tokens"] == 1 and p["temperature"] == 0 and p["repetition_penalty"] == 1 and job.cmd.logprobs:
        return ("greedy-one",)
    sampled = (p["temperature"], p["top_p"], p["top_k"]) if p["temperature"] > 0 else (0,)
    return ("generated", *sampled, p["repetition_penalty"], tuple(p["stop"] or ()))


def _groups(control: Plane, jobs: list[Job]) -> list[list[Job]]:
    """The jobs in groups that share a pass, in order of first arrival, each at most BATCH_ROWS
    rows (a larger job alone); under pipeline parallelism every generation alone."""
    alone = control.trainer.ctx.layout.kind is Layout.PIPELINE
    groups: dict[tuple, list[list[Job]]] = {}
    for job in jobs:
        kind = _kind(job)
        chunks = groups.setdefault(kind, [[]])
        last = chunks[-1]
        full = sum(len(j.rows) for j in last) + len(job.rows) > BATCH_ROWS
        if last and (full or (alone and kind[0] == "generated")):
            last = []
            chunks.append(last)
        last.append(job)
    return [chunk for chunks in groups.values() for chunk in chunks]


# -- generation and scoring ---------------------------------------------------------------------------
def _sample(control: Plane, group: list[Job]) -> None:
    """Every job's new tokens and text (none with max_new_tokens 0)."""
    trainer = control.trainer
    tok = trainer.tokenizer
    kind = _kind(group[0])
    for job in group:
        job.batch = len(group)
    if kind[0] == "scored":
        for job in group:
            job.new, job.texts = [[] for _ in job.rows], ["" for _ in job.rows]
        return
    if kind[0] == "greedy-one":  # one greedy token per row, read off the scoring pass
        picked = iter(score(trainer.ctx, [r for j in group for r in j.rows], 1))
        for job in group:
            new = [new_tokens([next(picked).next_top[0][0]], tok) for _ in job.rows]
            _finish(tok, job, new)
        return
    if trainer.ctx.layout.kind is Layout.PIPELINE:
        _sample_alone(control, group[0])
        return
    p = group[0].params
    requests = [Request(j.rows, j.params["max_new_tokens"], j.params["seed"], _stream(control, j)) for j in group]
    answers = generate_requests(trainer.ctx, requests, temperature=p["temperature"], top_p=p["top_p"],
                                top_k=p["top_k"], repetition_penalty=p["repetition_penalty"], stop=p["stop"])
    for job, new in zip(group, answers):
        _finish(tok, job, new)


def _stream(control: Plane, job: Job) -> Callable[[str], None] | None:
    """Where a single-sample request that asked to stream sends its text (rank 0 only). Each
    piece names the step and seed that answer (the API's `system_fingerprint`, on every chunk
    from the first, as OpenAI's streams carry it)."""
    if control.rank == 0 and job.cmd.stream and len(job.rows) == 1:
        step, seed = control.trainer.state.global_step, job.params["seed"]
        return lambda text, reply=job.reply: reply.token(text, "current", step=step, seed=seed)
    return None


def _finish(tok, job: Job, new: list[list[int]]) -> None:
    """The texts (cut at the first stop string) and the ids that cover them."""
    texts = [_cut(tok.decode(n, skip_special_tokens=True), job.params["stop"]) for n in new]
    job.new, job.texts = [_covering(tok, n, t) for n, t in zip(new, texts)], texts


def _sample_alone(control: Plane, job: Job) -> None:
    """One request through the layout's own generate (pipeline parallelism)."""
    trainer = control.trainer
    ids: list[list[list[int]]] = []
    texts = generate(trainer.ctx, job.rows, **job.params, on_ids=ids.append, on_text=_stream(control, job))
    job.new = [_covering(trainer.tokenizer, n, t) for n, t in zip(ids[0], texts)]
    job.texts = texts


def _score(control: Plane, jobs: list[Job]) -> None:
    """Every job's rows (prompt + new tokens) scored in one pass."""
    if not jobs:
        return
    top = max(j.cmd.top_logprobs for j in jobs)
    scores = iter(score(control.trainer.ctx, [r + n for j in jobs for r, n in zip(j.rows, j.new or [])], top))
    for job in jobs:
        job.scores = [next(scores) for _ in job.rows]


def _cut(text: str, stop: list[str] | None) -> str:
    for s in stop or []:
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    return text


def _covering(tokenizer, ids: list[int], text: str) -> list[int]:
    """The fewest of `ids` whose text covers `text` where a stop string cut the rest off; all of
    them (the end token too) where nothing was cut."""
    if tokenizer.decode(ids, skip_special_tokens=True) == text:
        return ids
    for k in range(len(ids) + 1):
        if len(tokenizer.decode(ids[:k], skip_special_tokens=True)) >= len(text):
            return ids[:k]
    return ids


def _choice(tok, index: int, prompt: list[int], new: list[int], text: str, params: dict[str, Any],
            cmd: Complete, scores: RowScores | None) -> dict[str, Any]:
    limit = params["max_new_tokens"]
    ended = bool(new) and new[-1] in end_ids(tok) or text != tok.decode(new, skip_special_tokens=True)
    finish = "length" if limit and len(new) >= limit and not ended else "stop"
    # `echo`: a text prompt exactly as it was sent (the BOS token the tokenizer put in front is
    # not part of it); token ids as the text they decode to
    sent = cmd.prompts[index // cmd.n] if cmd.echo and cmd.prompts is not None else None
    text_sent = isinstance(sent, str)
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish, "token_ids": new,
                              "prompt": (sent if text_sent else tok.decode(prompt)) if cmd.echo else None,
                              "logprobs": None}
    if scores is not None:
        first = 0 if cmd.echo else len(prompt)
        # a chat lists the tokens of its message; a completion every token, its end token too
        last = len(scores.tokens) - (1 if cmd.messages is not None and new and new[-1] in end_ids(tok) else 0)
        unseen = set(tok.all_special_ids) if text_sent else set()
        choice["logprobs"] = _logprobs(tok, scores, first, last, cmd.top_logprobs, unseen)
    return choice


def _logprobs(tok, scores: RowScores, first: int, last: int, top: int, unseen: set[int]) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object for tokens `first`..`last` (excluded) of the scored row;
    the `unseen` tokens (those the tokenizer added to a text prompt) take no room in `text_offset`."""
    pieces = [tok.decode([t]) for t in scores.tokens]
    offsets, at = [], 0
    for token, piece in zip(scores.tokens, pieces):
        offsets.append(at)
        at += 0 if token in unseen else len(piece)
    alternatives = [_top_dict(tok, pairs[:top]) if pairs else None for pairs in scores.top]
    if top == 0:  # the chosen token's own entry, as OpenAI lists it with logprobs=0
        alternatives = [None if lp is None else {p: lp} for p, lp in zip(pieces, scores.logprobs)]
    start = offsets[first] if first < len(offsets) else at
    return {"tokens": pieces[first:last], "token_logprobs": scores.logprobs[first:last],
            "top_logprobs": alternatives[first:last], "text_offset": [o - start for o in offsets[first:last]],
            "token_ids": scores.tokens[first:last]}


def _top_dict(tok, pairs: list[tuple[int, float]]) -> dict[str, float]:
    """{token text: log-probability}, most likely first (two ids of one text: the likelier kept)."""
    out: dict[str, float] = {}
    for token_id, lp in pairs:
        out.setdefault(tok.decode([token_id]), lp)
    return out
