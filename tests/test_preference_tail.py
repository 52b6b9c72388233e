"""The preference step's answer-only output head: the forwards compute the logits of the positions
that predict an answer token (`answer_tail`, transformers' `logits_to_keep`), and the scores are
those of the whole rows' logits (the TRL parity tests hold the objectives to TRL through it)."""

from types import SimpleNamespace

import pytest
import torch

from contract.data_rows import IGNORE
from engine.objectives.preference import answer_tail
from engine.objectives.losses import model_logits
from engine.objectives.preference_step import PreferenceStep


def _batch() -> dict:
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (4, 12))
    labels, mask = ids.clone(), torch.ones_like(ids)
    for row, prompt in enumerate((5, 7, 6, 9)):
        labels[row, :prompt] = IGNORE
    labels[1, 10:], mask[1, 10:], ids[1, 10:] = IGNORE, 0, 0  # right padding
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_answer_tail_counts_the_positions_from_the_one_before_the_first_answer_token():
    labels = _batch()["labels"]
    assert answer_tail(labels) == 12 - 5 + 1
    labels[2, 1] = 7  # an answer from the second token on: every position
    assert answer_tail(labels) == 0
    assert answer_tail(torch.full((2, 6), IGNORE)) == 0


def _models():
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(1)
    yield "llama", LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    yield "lora", peft.get_peft_model(LlamaForCausalLM(config), lora)
    prompt = peft.PromptTuningConfig(num_virtual_tokens=3, task_type="CAUSAL_LM")
    yield "prompt_tuning", peft.get_peft_model(LlamaForCausalLM(config), prompt)


class _NoKeep(torch.nn.Module):
    """A model whose forward has no `logits_to_keep`: it is asked for every position."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 96)

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        return SimpleNamespace(logits=self.head(self.embed(input_ids)))


@pytest.mark.parametrize("name, model", [*_models(), ("no_keep", _NoKeep())])
def test_answer_only_logits_give_the_whole_rows_scores(name, model):
    batch = _batch()
    forward = lambda i, m, keep=0: model_logits(model, i, m, keep)  # noqa: E731
    with torch.no_grad():
        kept = forward(batch["input_ids"], batch["attention_mask"], 8).size(1)
        whole = PreferenceStep._scores(forward, batch)
        answers = PreferenceStep._scores(forward, batch, tail=True)
    assert kept == (8 if name != "no_keep" else 12)  # prompt tuning's virtual positions are in front: gone too
    assert whole.token_logps.size(1) == 11 and answers.token_logps.size(1) == kept - 1
    assert torch.equal(answers.tokens, whole.tokens) and answers.tokens.tolist() == [7, 3, 6, 3]
    assert torch.allclose(answers.sums, whole.sums, rtol=1e-6, atol=1e-5), (answers.sums, whole.sums)
