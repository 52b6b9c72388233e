"""Fine-tuning methods: which parameters train, and PEFT adapters through the `peft` library.

"full", "lomo" and "adalomo" train every parameter (LOMO's fused update is a step strategy in
engine.lomo); the PEFT methods wrap the model in a `peft.PeftModel` whose active adapter is all
that trains: LoRA (target modules named, or inferred), prompt tuning and P-tuning.

What peft (0.21) does by itself for prompt tuning and P-tuning, and tests/test_peft.py checks:
its forward puts `num_virtual_tokens` learned embeddings in front of the input, puts -100 in
front of the labels (virtual positions are never targets; after the shift the last virtual
position predicts the first real label, which in our data formats is a prompt token, -100, or
bos), and puts ones in front of the
attention mask (every real token attends to the virtual ones, padding stays masked). It drops
`position_ids` with a warning, so packed rows, whose per-sample attention rests on them, cannot
be used with these two methods: the config validation rejects data.batching "packing" for them.
Logits come back with the virtual positions first; evaluators that read logits take the last
`input length` positions.

Several named adapters: a model that already is a PeftModel (say with an adapter loaded for
comparison) gets the configured adapter added next to the others under `method.adapter_name`;
that adapter is made the active one, and peft then trains only it.
"""

from __future__ import annotations

import torch

from contract.config import PEFT_METHODS, RunConfig

# Module names LoRA wraps when the config names none: the attention and MLP projections of the
# Llama / Qwen2 / Mistral family, and the fused ones of GPT-2-like models. Models with none of
# them get peft's "all-linear" (every linear layer but the output head).
_KNOWN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "c_attn", "c_proj", "c_fc", "query_key_value", "dense")


def _linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers
    return (torch.nn.Linear, Conv1D)


def infer_lora_targets(model: torch.nn.Module) -> list[str] | str:
    """The known projection names this model has, else peft's "all-linear"."""
    linear = _linear_types()
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, linear)}
    found = [t for t in _KNOWN_TARGETS if t in names]
    if found:
        return found
    if not names:
        raise ValueError("method.lora_target_modules: this model has no linear layers for LoRA to wrap")
    return "all-linear"


def peft_config(model: torch.nn.Module, cfg: RunConfig):
    """The peft config of the run's method, or None for the methods that are not PEFT."""
    import peft
    m = cfg.method
    if m.name == "lora":
        return peft.LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                               target_modules=m.lora_target_modules or infer_lora_targets(model),
                               task_type="CAUSAL_LM")
    if m.name == "prompt_tuning":
        return peft.PromptTuningConfig(num_virtual_tokens=m.num_virtual_tokens, task_type="CAUSAL_LM")
    if m.name == "p_tuning":
        # an MLP reparameterises the virtual tokens (the P-tuning paper's prompt encoder)
        return peft.PromptEncoderConfig(num_virtual_tokens=m.num_virtual_tokens, task_type="CAUSAL_LM",
                                        encoder_reparameterization_type="MLP")
    return None


def is_peft_model(model: torch.nn.Module) -> bool:
    from peft import PeftModel
    return isinstance(model, PeftModel)


def prepare_model(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """Wrap the model for the configured method (a PEFT adapter), or return it unchanged.

    A model that is a PeftModel already keeps its adapters; the configured one is added (if it
    is not there yet) and made the active, trained one.
    """
    if cfg.method.name not in PEFT_METHODS:
        if is_peft_model(model):
            raise ValueError(f"method.name: {cfg.method.name} trains the whole model, but the model given "
                             "is a PEFT model; choose lora, prompt_tuning or p_tuning")
        return model
    import peft
    name = cfg.method.adapter_name
    if not is_peft_model(model):
        return peft.get_peft_model(model, peft_config(model, cfg), adapter_name=name)
    if name not in model.peft_config:
        add_adapter(model, name, peft_config(model.get_base_model(), cfg))
    set_active_adapter(model, name)
    return model


def add_adapter(model, name: str, config) -> None:
    """Add adapter `name` (a peft config) to a PeftModel; the active adapter stays as it was."""
    if name in model.peft_config:
        raise ValueError(f"method.adapter_name: the model already has an adapter named {name!r} "
                         f"(it has {', '.join(model.peft_config)})")
    active = model.active_adapter
    model.add_adapter(name, config)
    model.set_adapter(active)


def set_active_adapter(model, name: str) -> None:
    """Make adapter `name` the one that is used and trained (peft freezes the others)."""
    if name not in model.peft_config:
        raise ValueError(f"method.adapter_name: no adapter named {name!r}; the model has "
                         f"{', '.join(model.peft_config)}")
    model.set_adapter(name)


def trainable_parameter_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]
