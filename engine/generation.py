"""Generation with the live engine's weights — the one entry point chat and evaluators share.

Every rank calls it with the same prompts (the control plane broadcasts them); under ZeRO-3 the
ranks gather each layer's shards together (`synced_gpus`), so all of them must keep stepping
until every rank is done. Dropout is off, train mode and every RNG are restored afterwards, so a
generation leaves the training trajectory exactly as it was.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
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


def encode_prompts(tokenizer, prompts: list[str], device,
                   add_special_tokens: bool = False) -> dict[str, torch.Tensor]:
    """Left-padded prompts (generation continues at the right edge of every row).

    `add_special_tokens`: False for text a chat template rendered (it holds its own special
    tokens); True for raw `input` text, encoded as the data layer encodes training inputs.
    """
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)
    finally:
        tokenizer.padding_side = side
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}


def generate(run: RunContext, prompts: list[str], *, max_new_tokens: int = 32, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0, seed: int = 0,
             stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
             use_base: bool = False, add_special_tokens: bool = False) -> list[str]:
    """Generate a completion of each prompt with the engine's current weights (collective).

    `run`: the run's context (a Trainer has the same attributes). `use_base` answers with the
    PEFT adapter disabled: the base model, at no extra memory. The run's layout does the work
    (under pipeline parallelism the stages generate together: engine.pipeline_generate).
    """
    return run.layout.generate(run, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                               seed=seed, stop=stop, on_text=on_text, use_base=use_base,
                               add_special_tokens=add_special_tokens)


def hf_generate(run: RunContext, prompts: list[str], *, max_new_tokens: int = 32, temperature: float = 0.0,
                top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0, seed: int = 0,
                stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
                use_base: bool = False, add_special_tokens: bool = False) -> list[str]:
    """`generate` on a model every rank holds whole or in shards (Hugging Face's generate; under
    ZeRO-3 the ranks keep stepping together until every rank is done)."""
    engine, tok = run.engine, run.tokenizer
    model = engine.module
    inputs = encode_prompts(tok, prompts, engine.device, add_special_tokens)
    sample = temperature > 0
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, repetition_penalty=repetition_penalty,
                  synced_gpus=run.config.parallel.zero_stage == 3 and run.env.world_size > 1)
    if sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k or None)
    if stop:
        kwargs.update(stop_strings=stop, tokenizer=tok)
    if on_text is not None:
        kwargs["streamer"] = CallbackStreamer(tok, on_text, inputs["input_ids"].shape[1])
    adapter_off = run.method.base_model(model) if use_base else contextlib.nullcontext()
    was_training = model.training
    with preserved_rng(), torch.no_grad(), adapter_off:
        torch.manual_seed(seed)
        model.eval()
        try:
            out = model.generate(**inputs, **kwargs)
        finally:
            model.train(was_training)
    new = out[:, inputs["input_ids"].shape[1]:]
    texts = tok.batch_decode(new, skip_special_tokens=True)
    return [cut_at_stop(t, stop) for t in texts]


def cut_at_stop(text: str, stop: list[str] | None) -> str:
    for s in stop or []:
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    return text
