"""Generation with the live engine's weights — the one entry point chat and evaluators share.

Every rank calls it with the same prompts (the control plane broadcasts them); under ZeRO-3 the
ranks gather each layer's shards together (`synced_gpus`), so all of them must keep stepping
until every rank is done. Dropout is off, train mode and every RNG are restored afterwards, so a
generation leaves the training trajectory exactly as it was.

Seeds: a sample asked for without a seed draws a fresh one (`fresh_seed`: rank 0 draws it from the
operating system, not from any of the run's generators, and every rank gets the same), so two
unseeded samples differ; the caller reports the seed it used, so the sample can be repeated.

A prompt is text, or a list of token ids (what lm-evaluation-harness sends); `on_ids` hears the
ids of each row's new tokens (the API's log-probabilities score them, engine.generation.scoring).
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from transformers.generation.streamers import BaseStreamer

from engine.context import RunContext
from engine.rng import preserved_rng


class CallbackStreamer(BaseStreamer):
    """Decodes new tokens as they come and hands the new text to `on_text` (rank 0 streams it)."""

    def __init__(self, tokenizer, on_text: Callable[[str], None], prompt_len: int):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.prompt_len, self.seen, self.ids, self.first = prompt_len, 0, [], True

    def put(self, value: torch.Tensor) -> None:
        if self.first:  # generate() first hands over the prompt itself
            self.first = False
            return
        self.ids.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if len(text) > self.seen and not text.endswith("\ufffd"):  # wait for whole characters
            self.on_text(text[self.seen:])
            self.seen = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if len(text) > self.seen:
            self.on_text(text[self.seen:])
            self.seen = len(text)


Prompt = str | Sequence[int]  # text, or the token ids themselves


def encode_prompts(tokenizer, prompts: Sequence[Prompt], device,
                   add_special_tokens: bool = False) -> dict[str, torch.Tensor]:
    """Left-padded prompts (generation continues at the right edge of every row).

    `add_special_tokens`: False for text a chat template rendered (it holds its own special
    tokens); True for raw `input` text, encoded as the data layer encodes training inputs.
    Token-id prompts are taken as they are.
    """
    if prompts and not isinstance(prompts[0], str):
        return pad_ids([list(p) for p in prompts], pad_id(tokenizer), device, left=True)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)
    finally:
        tokenizer.padding_side = side
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}


def pad_id(tokenizer) -> int:
    """The id that pads a row (the end token where the tokenizer names no pad)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad if pad is not None else 0)


def pad_ids(rows: list[list[int]], pad: int, device, left: bool) -> dict[str, torch.Tensor]:
    """Token-id rows padded to one length (on the left for generation, on the right for scoring,
    where a causal model's real tokens then keep their plain positions)."""
    if not rows or not all(rows):
        raise ValueError("every prompt needs at least one token")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def fresh_seed() -> int:
    """A new sampling seed, the same on every rank: rank 0 draws it from the operating system
    (never from the run's generators, which stay as they were) and broadcasts it. Collective:
    every rank calls it at the same point (a command's handler)."""
    seed = [secrets.randbits(63)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(seed, src=0)
    return int(seed[0])


def generate(run: RunContext, prompts: Sequence[Prompt], *, max_new_tokens: int = 32, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0, seed: int | None = None,
             stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
             use_base: bool = False, add_special_tokens: bool = False,
             on_ids: Callable[[list[list[int]]], None] | None = None) -> list[str]:
    """Generate a completion of each prompt with the engine's current weights (collective).

    `run`: the run's context (a Trainer has the same attributes). `use_base` answers with the
    PEFT adapter disabled: the base model, at no extra memory. The run's layout does the work
    (under pipeline parallelism the stages generate together: engine.generation.pipeline).
    `seed` None: a fresh one when sampling (`fresh_seed`); a caller that reports the seed draws
    it first. Greedy decoding draws nothing (no collective), its seed is moot.
    """
    if seed is None:
        seed = fresh_seed() if temperature > 0 else 0
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                   repetition_penalty=repetition_penalty, seed=seed,
                   stop=stop, on_text=on_text, use_base=use_base, add_special_tokens=add_special_tokens)
    if on_ids is not None:
        options["on_ids"] = on_ids
    return run.layout.generate(run, list(prompts), **options)


def hf_generate(run: RunContext, prompts: Sequence[Prompt], *, max_new_tokens: int = 32, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0, seed: int = 0,
                stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
                use_base: bool = False, add_special_tokens: bool = False,
                on_ids: Callable[[list[list[int]]], None] | None = None) -> list[str]:
    """`generate` on a model every rank holds whole or in shards (Hugging Face's generate; under
    ZeRO-3 the ranks keep stepping together until every rank is done)."""
    engine, tok = run.engine, run.tokenizer
    inputs = encode_prompts(tok, prompts, engine.device, add_special_tokens)
    sample = temperature > 0
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, repetition_penalty=repetition_penalty)
    if sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k or None)
    if stop:
        kwargs.update(stop_strings=stop, tokenizer=tok)
    if on_text is not None:
        kwargs["streamer"] = CallbackStreamer(tok, on_text, inputs["input_ids"].shape[1])
    out = model_generate(run, inputs, kwargs, seed=seed, use_base=use_base)
    new = out[:, inputs["input_ids"].shape[1]:]
    texts = tok.batch_decode(new, skip_special_tokens=True)
    if on_ids is not None:
        on_ids([new_tokens(row, tok) for row in new.tolist()])
    return [cut_at_stop(t, stop) for t in texts]


def model_generate(run: RunContext, inputs: dict[str, torch.Tensor], kwargs: dict, seed: int = 0,
                   use_base: bool = False) -> torch.Tensor:
    """Hugging Face's generate on the engine's model (collective under ZeRO-3: `synced_gpus`, set
    here): eval mode and no gradients, the global RNG seeded with `seed` and every RNG, the train
    mode and (with `use_base`) the PEFT adapter put back afterwards. Returns prompt + new ids."""
    model = run.engine.module
    kwargs = {**kwargs, "synced_gpus": run.config.parallel.zero_stage == 3 and run.env.world_size > 1}
    adapter_off = run.method.base_model(model) if use_base else contextlib.nullcontext()
    was_training = model.training
    with preserved_rng(), torch.no_grad(), adapter_off:
        torch.manual_seed(seed)
        model.eval()
        try:
            return model.generate(**inputs, **kwargs)
        finally:
            model.train(was_training)


def end_ids(tokenizer) -> set[int]:
    """The ids that end a generation (the tokenizer's end token or tokens)."""
    eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def new_tokens(row: list[int], tokenizer) -> list[int]:
    """A row's generated ids up to its end token, which is kept (it was generated, and an OpenAI
    client scoring `echo` + one new token counts on that one token being there); the padding
    after it is dropped."""
    ends = end_ids(tokenizer)
    for i, token in enumerate(row):
        if token in ends:
            return row[:i + 1]
    return row


def cut_at_stop(text: str, stop: list[str] | None) -> str:
    for s in stop or []:
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    return text
