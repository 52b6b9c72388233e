"""PEFT methods through `peft`: LoRA targets, what prompt tuning / P-tuning do with labels and
attention, several named adapters, and (2 ranks, ZeRO 0-3, our Trainer) that only the adapter
trains, the loss goes down, and the adapter saved by the trainer reloads in peft."""

import pytest
import torch

from dist_utils import SCRIPTS, parse_results, run_deepspeed
from engine.model import methods
from contract.config.schema import ConfigError
from contract.config.load import load_config


def llama(seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64), dtype=torch.float32)


def cfg(method, **method_fields):
    return load_config(data={"method": {"name": method, **method_fields}})


def test_lora_targets_inferred_or_chosen():
    from transformers import GPT2Config, GPT2LMHeadModel
    assert methods.infer_lora_targets(llama()) == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"]
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    assert methods.infer_lora_targets(gpt2) == ["c_attn", "c_proj", "c_fc"]  # Conv1D layers count

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 4)

    assert methods.infer_lora_targets(Odd()) == ["fc1"]  # no blocks: every linear layer but a head
    chosen = methods.prepare_model(llama(), cfg("lora", lora_target_modules=["v_proj"]))
    names = methods.trainable_parameter_names(chosen)
    assert names and all("v_proj.lora_" in n for n in names)
    inferred = methods.prepare_model(llama(), cfg("lora"))
    assert {n.split(".")[-4] for n in methods.trainable_parameter_names(inferred)} == set(
        methods.infer_lora_targets(llama()))


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning"])
def test_virtual_tokens_are_out_of_the_labels_and_in_the_attention(method):
    model = methods.prepare_model(llama(), cfg(method, num_virtual_tokens=5))
    model.eval()
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0                      # the second row is padded (right)
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits.shape[1] == 5 + 7  # virtual positions come first
    # the loss counts the real tokens only: labels at the virtual positions are -100. After the
    # shift the last virtual position predicts the first real label (peft's choice; in our data
    # formats that one is a prompt token, -100, or bos)
    targets = torch.cat([torch.full((2, 5), -100), labels], dim=1)[:, 1:]
    manual = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 64), targets.reshape(-1),
                                               ignore_index=-100)
    assert float(out.loss) == pytest.approx(float(manual), rel=1e-5)
    real_only = torch.nn.functional.cross_entropy(out.logits[:, 4:-1].reshape(-1, 64), labels.reshape(-1),
                                                  ignore_index=-100)
    assert float(out.loss) == pytest.approx(float(real_only), rel=1e-5)
    # padding stays masked: changing a padded token changes nothing the real tokens see
    other = ids.clone()
    other[1, 6] = 3
    again = model(input_ids=other, attention_mask=mask).logits
    assert torch.allclose(again[1, 5:10], out.logits[1, 5:10], atol=1e-6)
    # the virtual tokens are attended: changing them changes the real tokens' outputs
    with torch.no_grad():
        for p in model.prompt_encoder.parameters():
            p.add_(1.0)
    changed = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(changed[:, 5:], out.logits[:, 5:], atol=1e-4)
    assert all("prompt_encoder" in n for n in methods.trainable_parameter_names(model))


def test_prompt_methods_reject_packing():
    with pytest.raises(ConfigError, match="data.batching"):
        load_config(overrides=["method=prompt_tuning", "data.batching=packing"])
    load_config(overrides=["method=lora", "data.batching=packing"])


def test_several_named_adapters():
    import peft
    first = peft.get_peft_model(llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]), adapter_name="other")
    model = methods.prepare_model(first, cfg("lora", adapter_name="mine", lora_r=4))
    assert set(model.peft_config) == {"other", "mine"} and model.active_adapter == "mine"
    names = methods.trainable_parameter_names(model)
    assert names and all(".mine." in n for n in names)  # only the configured adapter trains
    x = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # LoRA B starts at zero: make both adapters do something
        mine = model(input_ids=x).logits
        methods.set_active_adapter(model, "other")
        other = model(input_ids=x).logits
    assert not torch.allclose(mine, other)
    assert all(".other." in n for n in methods.trainable_parameter_names(model))
    with pytest.raises(ValueError, match="method.adapter_name"):
        methods.set_active_adapter(model, "missing")
    with pytest.raises(ValueError, match="method.adapter_name"):
        methods.add_adapter(model, "mine", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="method.name"):
        methods.prepare_model(model, cfg("full"))


# -- 2 ranks, real DeepSpeed, our Trainer ---------------------------------------------------------

# LoRA under every stage; the prompt-learning methods under ZeRO-3 too, where saving them once
# hung (peft runs their prompt encoder to save them, a collective forward under ZeRO-3).
RUNS = {0: "lora,p_tuning", 1: "lora", 2: "lora", 3: "lora,prompt_tuning,p_tuning"}


@pytest.fixture(scope="module")
def by_stage(tmp_path_factory) -> dict[int, list[dict]]:
    """Every stage's runs in one launch (a 2-rank start costs more than the 20 steps): one Trainer,
    engine and model per stage and method, one after the other in the same process group."""
    out = tmp_path_factory.mktemp("peft")
    proc = run_deepspeed(SCRIPTS / "peft_check.py", nproc=2,
                         args=("--runs", *(f"{z}={m}" for z, m in sorted(RUNS.items())), "--out", str(out)),
                         timeout=1500)
    results = parse_results(proc)
    return {z: [r for r in results if r["zero"] == z] for z in RUNS}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("zero", sorted(RUNS))
def test_only_the_adapter_trains_and_reloads_in_peft(by_stage, zero):
    results = by_stage[zero]
    assert len(results) == 2 * len(RUNS[zero].split(","))
    for r in results:
        losses = r["losses"]
        assert sum(losses[-4:]) / 4 < 0.97 * sum(losses[:4]) / 4, (r["method"], losses)
        assert r["frozen_moved"] == 0.0                       # the base model did not change at all
        assert r["adapter_moved"] > 1e-4
        assert 0 < r["trainable_numel"] < 0.2 * r["total_numel"]
        assert r["only_adapter"] and r["trainable"], r["trainable"]
        assert "adapter_config.json" in r["saved"] and "adapter_model.safetensors" in r["saved"]
        assert r["reload_diff"] < 1e-4, r                     # peft reloads the very adapter trained
    for method in RUNS[zero].split(","):
        r0, r1 = (r for r in results if r["method"] == method)
        assert r0["losses"] == r1["losses"]
