"""Fine-tuning methods: which parameters train, and PEFT adapters through the `peft` library.

"full", "lomo" and "adalomo" train every parameter (LOMO's fused update is a step strategy);
the PEFT methods wrap the model in a `peft.PeftModel` and train only the adapter.
"""

from __future__ import annotations

import torch

from engine.config import RunConfig

# Module names LoRA wraps when the config names none: the attention and MLP projections of the
# Llama / Qwen2 / Mistral family, and the fused ones of GPT-2-like models.
_KNOWN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "c_attn", "c_proj", "query_key_value", "dense")


def infer_lora_targets(model: torch.nn.Module) -> list[str]:
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    found = [t for t in _KNOWN_TARGETS if t in names]
    if not found:
        raise ValueError(f"method.lora_target_modules: cannot infer LoRA targets; linear layers "
                         f"of this model: {sorted(names)}")
    return found


def peft_config(model: torch.nn.Module, cfg: RunConfig):
    import peft
    m = cfg.method
    if m.name == "lora":
        return peft.LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                               target_modules=m.lora_target_modules or infer_lora_targets(model),
                               task_type="CAUSAL_LM")
    if m.name == "prompt_tuning":
        return peft.PromptTuningConfig(num_virtual_tokens=m.num_virtual_tokens, task_type="CAUSAL_LM")
    if m.name == "p_tuning":
        return peft.PromptEncoderConfig(num_virtual_tokens=m.num_virtual_tokens, task_type="CAUSAL_LM")
    return None


def prepare_model(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """Wrap the model for the configured method (a PEFT adapter), or return it unchanged."""
    config = peft_config(model, cfg)
    if config is None:
        return model
    import peft
    return peft.get_peft_model(model, config, adapter_name=cfg.method.adapter_name)
