"""Generation under pipeline parallelism: the prompt flows through the stages.

Every rank of a pipeline calls `pipeline_generate` with the same prompts (the control plane
broadcasts them). Each step:

    stage 0 embeds the new tokens and runs its layers --hidden--> stage 1 ... --> last stage
    the last stage turns the logits into the next tokens (greedy or sampled, the same logits
    processors as transformers' generate) and broadcasts them to every stage of its pipeline

Each stage keeps a transformers KV cache for its own layers only, so after the prompt each
step moves one token's hidden state per row between stages. Positions and the attention mask
follow transformers' generate (left padding, positions counted over the real tokens, finished
rows padded), so greedy tokens equal a one-rank model's for the same weights. Rank 0 is on the
first stage and streams the text through `on_text` as the tokens arrive.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from engine.context import RunContext
from engine.generation.generate import CallbackStreamer, cut_at_stop, encode_prompts, new_tokens
from engine.parallel.pipeline import broadcast_from_last_stage, stage_forward
from engine.rng import preserved_rng


def logits_processors(temperature: float, top_p: float, top_k: int,
                      repetition_penalty: float) -> LogitsProcessorList:
    """What transformers' generate applies for these settings, in its order."""
    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if temperature > 0:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
    return processors


def next_tokens(logits: torch.Tensor, generated: torch.Tensor, processors: LogitsProcessorList,
                sample: bool) -> torch.Tensor:
    scores = processors(generated, logits.float())
    if sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return scores.argmax(dim=-1)


def pipeline_generate(run: RunContext, prompts: list[str], *, max_new_tokens: int = 32, temperature: float = 0.0,
                      top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0, seed: int = 0,
                      stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
                      use_base: bool = False, add_special_tokens: bool = False,
                      on_ids: Callable[[list[list[int]]], None] | None = None) -> list[str]:
    """Generate a completion of each prompt with the pipeline's current weights (collective
    over the pipeline); the same arguments and result as engine.generation.generate.generate."""
    if use_base:
        raise ValueError("use_base: there is no PEFT adapter under pipeline parallelism")
    engine, tok = run.engine, run.tokenizer
    module = engine.module
    inputs = encode_prompts(tok, prompts, engine.device, add_special_tokens)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    streamer = CallbackStreamer(tok, on_text, ids.shape[1]) if on_text is not None else None
    was_training = module.training
    with preserved_rng(), torch.no_grad():
        torch.manual_seed(seed)
        module.eval()
        module.set_cache(DynamicCache(config=module.hf_config))
        try:
            generated = _decode(engine, ids, mask, tok, max_new_tokens, stop, streamer,
                                logits_processors(temperature, top_p, top_k, repetition_penalty),
                                sample=temperature > 0)
        finally:
            module.set_cache(None)
            module.train(was_training)
    if streamer is not None:
        streamer.end()
    texts = tok.batch_decode(generated[:, ids.shape[1]:], skip_special_tokens=True)
    if on_ids is not None:
        on_ids([new_tokens(row, tok) for row in generated[:, ids.shape[1]:].tolist()])
    return [cut_at_stop(t, stop) for t in texts]


def _decode(engine, ids: torch.Tensor, mask: torch.Tensor, tok, max_new_tokens: int,
            stop: list[str] | None, streamer, processors, sample: bool) -> torch.Tensor:
    """The token loop; returns prompt + new tokens (finished rows padded), as generate does."""
    rows, prompt_len = ids.shape
    eos = torch.tensor(_eos_ids(tok), device=ids.device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else int(eos[0])
    # transformers' positions for a left-padded prompt: count the real tokens, pads at 0
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    unfinished = torch.ones(rows, dtype=torch.bool, device=ids.device)
    generated, step_ids, step_positions = ids, ids, positions
    if streamer is not None:
        streamer.put(ids.cpu())  # the streamer skips this first call, the prompt
    for _ in range(max_new_tokens):
        logits = stage_forward(engine, (step_ids, mask, step_positions))
        chosen = torch.zeros(rows, dtype=torch.long, device=ids.device)
        if logits is not None:  # the last stage decides
            chosen = next_tokens(logits[:, -1, :], generated, processors, sample)
        chosen = broadcast_from_last_stage(engine, chosen)
        chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad))
        generated = torch.cat([generated, chosen[:, None]], dim=1)
        if streamer is not None:
            streamer.put(chosen.cpu())
        unfinished &= ~torch.isin(chosen, eos)
        if stop:
            unfinished &= ~_hit_stop(tok, generated[:, prompt_len:], stop)
        if not unfinished.any():
            break
        mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        step_ids, step_positions = chosen[:, None], step_positions[:, -1:] + 1
    return generated


def _eos_ids(tok) -> list[int]:
    eos = tok.eos_token_id
    if eos is None:
        return [-1]  # no end token: only max_new_tokens or a stop string ends a row
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def _hit_stop(tok, new_tokens: torch.Tensor, stop: list[str]) -> torch.Tensor:
    texts = tok.batch_decode(new_tokens, skip_special_tokens=True)
    return torch.tensor([any(s in t for s in stop) for t in texts], device=new_tokens.device)

