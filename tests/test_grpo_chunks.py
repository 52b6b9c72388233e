"""GRPO's answer log-probabilities with the output head in chunks (`train.logits_chunk_rows`,
engine.objectives.grpo_step.chunked_answer_logps): no head call sees more rows than a chunk (so
one chunk's (rows, vocab) logits exist at once, not the micro-batch's), and the log-probabilities
and their gradients equal the unchunked ones (the model's whole logits, then the log-softmax)
within fp32 rounding, with and without LoRA and a temperature; a model that soft-caps its logits
(Gemma2), a chunk size of 0 or fewer rows than a chunk leave it to the unchunked path. The whole
runs (TRL parity, the live GRPO tests) take this path wherever their answers outgrow a chunk."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from engine.objectives.grpo import token_logps
from engine.objectives.grpo_step import chunked_answer_logps

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=700, num_key_value_heads=2, **SMALL))


def _samples(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four answers of 9 tokens after prompts of 6 (the first two left-padded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 700, (4, 15), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2], mask[1, :1] = 0, 0
    return ids, mask, ids[:, 6:]


def _unchunked(model, ids, mask, completion, temperature):
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    c = completion.size(1)
    return token_logps(logits[:, -(c + 1):-1], completion, temperature)


def _with_grads(fn, model):
    model.zero_grad()
    logps = fn()
    (logps * torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps)).sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_answer_logps_and_grads_equal_the_whole_logits(lora, temperature):
    model = _llama()
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"],
                                                 init_lora_weights=False))
    ids, mask, completion = _samples()
    head = model.get_output_embeddings()
    seen: list[int] = []
    hook = head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[:-1].numel()))
    try:
        chunked, chunked_grads = _with_grads(
            lambda: chunked_answer_logps(model, ids, mask, completion, temperature, rows=10), model)
    finally:
        hook.remove()
    whole, whole_grads = _with_grads(lambda: _unchunked(model, ids, mask, completion, temperature), model)
    assert chunked.shape == completion.shape
    # 36 answer positions: 4 chunks of at most 10 rows (and the recomputation in the backward),
    # the forward's own head call on no row at all
    assert max(seen) == 10 and sum(seen) == 2 * completion.numel()
    assert torch.allclose(chunked, whole, atol=1e-6, rtol=0)
    assert chunked_grads.keys() == whole_grads.keys() and chunked_grads
    for name, grad in whole_grads.items():
        assert torch.allclose(chunked_grads[name], grad, atol=1e-6, rtol=1e-5), name


def test_not_chunked_where_it_does_not_apply():
    ids, mask, completion = _samples()
    model = _llama()
    assert chunked_answer_logps(model, ids, mask, completion, 1.0, rows=0) is None
    assert chunked_answer_logps(model, ids, mask, completion, 1.0, rows=completion.numel()) is None
    capped = Gemma2ForCausalLM(Gemma2Config(vocab_size=700, num_key_value_heads=2, head_dim=8,
                                            final_logit_softcapping=30.0, **SMALL))
    assert chunked_answer_logps(capped, ids, mask, completion, 1.0, rows=10) is None
