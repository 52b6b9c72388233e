"""The output head only at labelled positions (`train.logits_at_labels`, engine.objectives.losses):
the head sees only the rows that predict a label, and the loss and its gradients are the model's
own (the HF Trainer's) within fp32 rounding, for several architectures, with and without the
step's token count, with LoRA; where it cannot apply (prompt-learning PEFT, a model of one's
own) the model's own loss is taken as before. The cross-entropy in chunks
(`train.logits_chunk_rows`): no head call sees more rows than a chunk, loss and gradients equal
the unchunked ones; a model that soft-caps its logits (Gemma2) is not chunked. The whole runs (the HF Trainer's losses, the golden
losses, every layout) go through it by default: tests/test_hf_equivalence.py and the others."""

from __future__ import annotations

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig,
                          GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from contract.config.load import load_config
from engine.objectives.losses import Window, head_at_labels, label_positions, model_loss, plain_head

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=500, num_key_value_heads=2, **SMALL)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=500, num_key_value_heads=2, tie_word_embeddings=True,
                                                  **SMALL)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=500, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neox": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=500, **SMALL)),
}


def _batch(seed: int = 0) -> dict:
    """Three rows with prompts of different lengths (label -100), one shorter row padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (3, 16), generator=g)
    labels, mask = ids.clone(), torch.ones_like(ids)
    labels[0, :4], labels[1, :9], labels[2, :6] = -100, -100, -100
    labels[2, 12:], mask[2, 12:] = -100, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model, batch, window, at_labels, chunk_rows=0):
    model.zero_grad()
    loss = model_loss(model, batch, "cpu", None, window, at_labels=at_labels, chunk_rows=chunk_rows)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rows_into_head(model, batch, window, at_labels) -> int:
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].shape[:-1].numel()))
    try:
        model_loss(model, batch, "cpu", None, window, at_labels=at_labels)
    finally:
        hook.remove()
    return sum(seen)


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("num_items", [None, 60])
def test_the_head_sees_only_labelled_rows_and_the_loss_is_the_models_own(arch, num_items):
    torch.manual_seed(0)
    model, batch = MODELS[arch](), _batch()
    window = Window(num_items=num_items)
    assert head_at_labels(model)
    _, targets = label_positions(batch["labels"], shifted=True)
    assert targets.numel() == 12 + 7 + 6  # rows 0-2: labels at 4..15, 9..15, 6..11, each predicted one position before
    assert _rows_into_head(model, batch, window, at_labels=True) == targets.numel()
    assert _rows_into_head(model, batch, window, at_labels=False) == 3 * 16
    ours, our_grads = _loss_and_grads(model, batch, window, at_labels=True)
    theirs, their_grads = _loss_and_grads(model, batch, window, at_labels=False)
    assert ours == pytest.approx(theirs, rel=1e-6)
    assert our_grads.keys() == their_grads.keys()
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_with_lora_and_not_with_prompt_tuning_or_a_model_of_ones_own():
    from peft import LoraConfig, PromptTuningConfig, get_peft_model
    torch.manual_seed(0)
    lora = get_peft_model(MODELS["llama"](), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert head_at_labels(lora)
    batch, window = _batch(1), Window(num_items=40)
    ours = float(model_loss(lora, batch, "cpu", None, window, at_labels=True))
    assert ours == pytest.approx(float(model_loss(lora, batch, "cpu", None, window, at_labels=False)), rel=1e-6)
    prompt = get_peft_model(MODELS["llama"](), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    assert not head_at_labels(prompt)  # virtual tokens in front of the labels: every position's logits

    class Own(torch.nn.Module):
        def forward(self, input_ids, labels=None, **_):
            raise AssertionError("not reached")
    assert not head_at_labels(Own())


def test_a_micro_batch_without_labels_weighs_nothing():
    torch.manual_seed(0)
    model, batch = MODELS["qwen2"](), _batch()
    batch["labels"][:] = -100
    loss = model_loss(model, batch, "cpu", None, Window(num_items=30), at_labels=True)
    assert float(loss) == 0.0
    loss.backward()  # the head and the blocks take part, with zero gradients (every rank's graph is the same)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)


def test_on_by_default_and_can_be_turned_off():
    assert load_config().train.logits_at_labels is True
    assert load_config(overrides=["train.logits_at_labels=false"]).train.logits_at_labels is False
    assert load_config().train.logits_chunk_rows == 1024
    assert load_config(overrides=["train.logits_chunk_rows=0"]).train.logits_chunk_rows == 0
    with pytest.raises(Exception, match="logits_chunk_rows"):
        load_config(overrides=["train.logits_chunk_rows=-1"])


def _head_calls(model, batch, window, chunk_rows) -> list[int]:
    """The rows of every call of the output head in one forward and backward."""
    rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(o.shape[0]))
    try:
        model_loss(model, batch, "cpu", None, window, at_labels=True, chunk_rows=chunk_rows).backward()
    finally:
        hook.remove()
    return rows


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("num_items", [None, 60])
def test_the_cross_entropy_in_chunks_equals_the_whole(arch, num_items):
    torch.manual_seed(0)
    model, batch = MODELS[arch](), _batch()
    window = Window(num_items=num_items)
    assert plain_head(model)
    # 25 labelled rows in chunks of 7: 7, 7, 7, 4 in the forward (after the head's empty call
    # inside the model's forward) and each chunk again in the backward (recomputed)
    assert _head_calls(model, batch, window, chunk_rows=7) == [0, 7, 7, 7, 4, 4, 7, 7, 7]
    ours, our_grads = _loss_and_grads(model, batch, window, at_labels=True, chunk_rows=7)
    whole, whole_grads = _loss_and_grads(model, batch, window, at_labels=True, chunk_rows=0)
    everywhere, _ = _loss_and_grads(model, batch, window, at_labels=False)
    assert ours == pytest.approx(whole, rel=1e-6) and ours == pytest.approx(everywhere, rel=1e-6)
    assert our_grads.keys() == whole_grads.keys()
    # a chunk's gradients are summed in another order: fp32 rounding (~1e-7 on grads up to ~0.4)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert _head_calls(model, batch, window, chunk_rows=25) == [25]  # not more rows than a chunk: one call


def test_chunks_with_lora_and_not_for_a_soft_capped_model():
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    lora = get_peft_model(MODELS["qwen2"](), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"]))
    batch, window = _batch(2), Window(num_items=40)
    assert plain_head(lora)
    ours, our_grads = _loss_and_grads(lora, batch, window, at_labels=True, chunk_rows=5)
    whole, whole_grads = _loss_and_grads(lora, batch, window, at_labels=True)
    assert ours == pytest.approx(whole, rel=1e-6)
    assert our_grads.keys() == whole_grads.keys() and any("lm_head.lora" in n for n in our_grads)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=500, head_dim=8, final_logit_softcapping=5.0, **SMALL))
    assert head_at_labels(gemma) and not plain_head(gemma)  # the soft-cap comes after the head
    assert _head_calls(gemma, batch, window, chunk_rows=5) == [25]  # the model's own forward, capped
    capped, _ = _loss_and_grads(gemma, batch, window, at_labels=True, chunk_rows=5)
    assert capped == pytest.approx(_loss_and_grads(gemma, batch, window, at_labels=False)[0], rel=1e-6)
