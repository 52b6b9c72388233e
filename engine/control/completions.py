"""The `complete` command's handler (contract.protocol.completion_commands.Complete): completions with
token log-probabilities, for the OpenAI-compatible API (supervisor.openai_api).

Run by every rank at a step boundary, like `generate`. Every prompt becomes token ids first (text
with the tokenizer's special tokens, as `generate` prompts get their BOS; a chat through the
model's chat template; ids as given), so all samples of all prompts are generated in one batch
(`n` rows per prompt). Log-probabilities come from one more forward pass over prompt + sampled
tokens (engine.scoring): the model's own distribution, before temperature or top-p. `echo` with
`max_new_tokens: 0` scores the prompt only; greedy with one new token (lm-evaluation-harness's
log-likelihood request) takes that token from the same pass. Nothing here touches the run's RNG
streams or train mode (engine.generation, engine.scoring restore them).
"""

from __future__ import annotations

from typing import Any

from contract.protocol.completion_commands import Complete
from engine.control.limits import context_tokens
from engine.control.pending import Reply
from engine.control.run import Plane
from engine.generation import end_ids, fresh_seed, generate, new_tokens
from engine.scoring import RowScores, score


class CompletionRefused(RuntimeError):
    """The request cannot be answered (the same on every rank); nothing was changed."""


def complete(control: Plane, cmd: Complete, reply: Reply) -> dict:
    """Answer `cmd`: every choice's text, finish reason, token ids and (with `logprobs`) scores."""
    trainer = control.trainer
    tok = trainer.tokenizer
    params = control.settings.generation_params(cmd.sampling())
    if params["seed"] is None:
        params["seed"] = fresh_seed()
    prompts = prompt_ids(tok, cmd)
    room = context_tokens(trainer.engine.module, tok) - max(len(p) for p in prompts)
    if room < (1 if params["max_new_tokens"] else 0):
        raise CompletionRefused(f"complete: the prompt fills the model's context of "
                                f"{context_tokens(trainer.engine.module, tok)} tokens; shorten it")
    params["max_new_tokens"] = min(params["max_new_tokens"], room)
    rows = [p for p in prompts for _ in range(cmd.n)]
    new, texts = _sample(control, cmd, rows, params, reply)
    top = cmd.top_logprobs if cmd.logprobs else 0
    scores = score(trainer.ctx, [r + n for r, n in zip(rows, new)], top) if cmd.logprobs else None
    choices = [_choice(tok, i, rows[i], new[i], texts[i], params, cmd,
                       scores[i] if scores is not None else None) for i in range(len(rows))]
    return {"step": trainer.state.global_step, "seed": params["seed"], "model": "current",
            "choices": choices,
            "usage": {"prompt_tokens": sum(len(p) for p in prompts),
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


def _sample(control: Plane, cmd: Complete, rows: list[list[int]], params: dict[str, Any],
            reply: Reply) -> tuple[list[list[int]], list[str]]:
    """The new tokens and text of every row (none with max_new_tokens 0)."""
    trainer = control.trainer
    if params["max_new_tokens"] == 0:
        return [[] for _ in rows], ["" for _ in rows]
    if params["max_new_tokens"] == 1 and params["temperature"] == 0 and params["repetition_penalty"] == 1 \
            and cmd.logprobs:
        return _greedy_one(trainer, rows, params)
    ids: list[list[list[int]]] = []
    streams = control.rank == 0 and cmd.stream and len(rows) == 1
    texts = generate(trainer.ctx, rows, **params, on_ids=ids.append,
                     on_text=(lambda t: reply.token(t, "current")) if streams else None)
    return [_covering(trainer.tokenizer, n, t) for n, t in zip(ids[0], texts)], texts


def _greedy_one(trainer, rows: list[list[int]], params: dict[str, Any]) -> tuple[list[list[int]], list[str]]:
    """One greedy token per row, read off the scoring pass (what generate would pick)."""
    tok = trainer.tokenizer
    picked = [[s.next_top[0][0]] for s in score(trainer.ctx, rows, 1)]
    new = [new_tokens(p, tok) for p in picked]
    texts = [_cut(tok.decode(n, skip_special_tokens=True), params["stop"]) for n in new]
    return [_covering(tok, n, t) for n, t in zip(new, texts)], texts


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
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish, "token_ids": new,
                              "prompt": tok.decode(prompt) if cmd.echo else None, "logprobs": None}
    if scores is not None:
        first = 0 if cmd.echo else len(prompt)
        # a chat lists the tokens of its message; a completion every token, its end token too
        last = len(scores.tokens) - (1 if cmd.messages is not None and new and new[-1] in end_ids(tok) else 0)
        choice["logprobs"] = _logprobs(tok, scores, first, last, cmd.top_logprobs)
    return choice


def _logprobs(tok, scores: RowScores, first: int, last: int, top: int) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object for tokens `first`..`last` (excluded) of the scored row."""
    pieces = [tok.decode([t]) for t in scores.tokens]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
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
