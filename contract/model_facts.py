"""What a model folder's config.json says, read torch-free through the names each architecture
uses for it.

transformers maps the common names onto an architecture's own (`PretrainedConfig.attribute_map`:
GPT-2 calls the attention heads `n_head`); reading the raw JSON must do the same, or GPT-2 looks
like a model without heads. ALIASES holds that map for the architectures livetune is tested on;
any other model_type is read by the common names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers' attribute_map (common name -> the architecture's own), per model_type. Only GPT-2
# renames the facts read here among gpt2, gpt_neox, opt, phi3, phi, gemma, qwen2, mistral and llama;
# the others use the common names (transformers 5: their configs declare no attribute_map for them).
ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
             "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"},
}
# Partition styles of an architecture's Hugging Face tp_plan that DeepSpeed AutoTP refuses
# (deepspeed.module_inject.tp_plan_converter.SUPPORTED_STYLES lacks them), read from the installed
# transformers' configuration_<type>.py: tensor parallelism is refused before start for these.
TP_UNSUPPORTED_STYLES: dict[str, tuple[str, ...]] = {
    "phi3": ("rowwise_split_input",),  # o_proj and down_proj (their input comes from a fused, sliced projection)
}
# Architectures DeepSpeed AutoTP refuses outright, tp_plan or not: `AutoTP.supported` (deepspeed
# 0.19 module_inject/auto_tp.py) excludes the models it keeps for inference kernel injection, and
# asserts "AutoTP not supported for model" after the ranks have started.
TP_UNSUPPORTED_MODELS: dict[str, str] = {
    "gpt2": "AutoTP excludes GPT-2 models (DeepSpeed keeps them for its inference kernel injection, "
            "which does not train)",
}
# The longest max_length a user's run starts from when it names none: the model's own context,
# but no more than this (a long context costs memory quadratically in attention).
CONTEXT_CAP = 2048


class ModelFolderProblem(ValueError):
    """A model folder whose config.json cannot be read; the message names the file and why."""


def read_model_config(folder: str | Path) -> dict:
    """The folder's config.json as a dict (its text part for multimodal configs); raises
    ModelFolderProblem naming the file when it is missing, not JSON or not an object."""
    path = Path(folder) / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelFolderProblem(f"{folder} has no config.json, so it is not a Hugging Face model "
                                 "folder (save one with save_pretrained)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFolderProblem(f"cannot read {path}: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFolderProblem(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, "
                                 f"column {e.colno}") from None
    if not isinstance(data, dict):
        raise ModelFolderProblem(f"{path} must hold a JSON object, not a JSON {type(data).__name__}")
    text_config = data.get("text_config")
    if isinstance(text_config, dict):
        return {"model_type": data.get("model_type"), **text_config}
    return data


def fact(config: dict, name: str) -> Any:
    """The value of the common attribute `name` (num_attention_heads, hidden_size, ...) in a raw
    config dict, through the architecture's own name for it; None when absent."""
    own = ALIASES.get(str(config.get("model_type")), {}).get(name)
    if own is not None and config.get(own) is not None:
        return config[own]
    return config.get(name)


def context_length(config: dict) -> int | None:
    """The longest sequence the model's positions allow (None when its config does not say)."""
    value = fact(config, "max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def tp_refusal(config: dict) -> str | None:
    """Why DeepSpeed AutoTP cannot split this architecture (None when it can, as far as known)."""
    kind = str(config.get("model_type"))
    if kind in TP_UNSUPPORTED_MODELS:
        return (f"DeepSpeed AutoTP cannot split a {kind!r} model: {TP_UNSUPPORTED_MODELS[kind]}; "
                "use tp_size 1 (ZeRO shards it instead)")
    styles = TP_UNSUPPORTED_STYLES.get(kind)
    if not styles:
        return None
    return (f"DeepSpeed AutoTP cannot split a {kind!r} model: its Hugging Face tp_plan uses the "
            f"partition style(s) {', '.join(styles)}, which AutoTP does not support; use tp_size 1 "
            "(ZeRO shards it instead)")
