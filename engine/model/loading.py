"""Build the tokenizer and the model of a run from a local Hugging Face folder.

The embedded default is such a folder too (config + tokenizer, no weights), so the path that
loads a user's real model is the one every test runs. A folder without weights is built from its
config with the run's seed.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import safetensors.torch
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from contract import hub
from contract.config.schema import ModelConfig, RunConfig
from engine.data.default_task import default_root, ensure_default_assets

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ModelFolderError(ValueError):
    pass


def has_weights(folder: Path) -> bool:
    return any((Path(folder) / name).exists() for name in WEIGHT_FILES)


def load_tokenizer(folder: str | Path, field: str = "model.tokenizer") -> PreTrainedTokenizerBase:
    """The folder's tokenizer, with a pad token (eos when the folder defines none).

    `field` is the config field that named the folder, for the error message."""
    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ModelFolderError(f"{field}: cannot load a tokenizer from {folder}: {e}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def model_dir_of(cfg: RunConfig) -> Path:
    """The run's model folder: model.path (a local folder, or a hub name found in the local
    cache), else the embedded default's (written once)."""
    return hub.local_folder(cfg.model.path) if cfg.model.path else ensure_default_assets(default_root()).model_dir


def tokenizer_of(cfg: RunConfig) -> PreTrainedTokenizerBase:
    """The run's tokenizer: model.tokenizer's folder, else the model folder's."""
    field = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    folder = hub.local_folder(cfg.model.tokenizer) if cfg.model.tokenizer else model_dir_of(cfg)
    return load_tokenizer(folder, field)


def hidden_size(folder: str | Path) -> int | None:
    config = AutoConfig.from_pretrained(str(folder))
    text = getattr(config, "text_config", None) or config
    return getattr(text, "hidden_size", None) or getattr(text, "d_model", None)


def read_config(folder: str | Path, *, trust_remote_code: bool = False):
    """The folder's transformers config; an unreadable one or an unknown architecture is a
    ModelFolderError naming model.path."""
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise ModelFolderError(f"model.path: {folder} is not a Hugging Face model folder: {e}") from None


def quantization_config(model: ModelConfig, precision: str):
    """transformers' BitsAndBytesConfig for `model.quantization` (None for "none"); the 4-bit
    compute dtype "auto" is the run's precision."""
    if model.quantization == "none":
        return None
    from transformers import BitsAndBytesConfig
    if model.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = precision if model.bnb_4bit_compute_dtype == "auto" else model.bnb_4bit_compute_dtype
    storage = torch.uint8 if model.bnb_4bit_quant_storage == "uint8" else DTYPES[model.bnb_4bit_quant_storage]
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=model.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=model.bnb_4bit_use_double_quant,
                              bnb_4bit_compute_dtype=DTYPES[compute], bnb_4bit_quant_storage=storage)


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether the model's base was loaded quantized (bitsandbytes 4-bit or 8-bit)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def _device() -> str:
    """Where a quantized model is placed: bitsandbytes quantizes as it moves the weights there."""
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def build_model(folder: str | Path, *, seed: int, precision: str, attn_implementation: str = "sdpa",
                gradient_checkpointing: bool = False, init_context=contextlib.nullcontext,
                trust_remote_code: bool = False, quantization=None) -> torch.nn.Module:
    """Load (or, without weights, initialise) a causal LM.

    `init_context` is the ZeRO-3 construction context from the DeepSpeed layer, so the model is
    partitioned while it is built and no rank ever holds all of it. `quantization` (a
    BitsAndBytesConfig, see `quantization_config`) loads the linear layers quantized; ZeRO-3 is
    refused for it by the config check, so no construction context applies.
    """
    folder = Path(folder)
    config = read_config(folder, trust_remote_code=trust_remote_code)
    torch.manual_seed(seed)
    _import_model_class(config)
    if quantization is not None:
        model = _build_quantized(folder, config, seed=seed, precision=precision, quantization=quantization,
                                 attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    else:
        model = _build_plain(folder, config, precision=precision, attn_implementation=attn_implementation,
                             init_context=init_context, trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def _build_plain(folder: Path, config, *, precision: str, attn_implementation: str, init_context,
                 trust_remote_code: bool) -> torch.nn.Module:
    with init_context():
        if has_weights(folder):
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=DTYPES[precision], attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code)
        else:
            # dtype: the run's precision, not the config's torch_dtype (the default model's config
            # says bfloat16, which would make an fp32 run train bf16 weights)
            model = AutoModelForCausalLM.from_config(
                config, dtype=DTYPES[precision], attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code)
    return model


def _build_quantized(folder: Path, config, *, seed: int, precision: str, quantization,
                     attn_implementation: str, trust_remote_code: bool) -> torch.nn.Module:
    """The model with its linear layers quantized as they load (transformers quantizes only in
    `from_pretrained`): a folder without weights is first initialised with the seed (the same
    weights an unquantized run of this seed starts from), and written to a temporary folder."""
    kwargs = dict(dtype=DTYPES[precision], attn_implementation=attn_implementation,
                  trust_remote_code=trust_remote_code, quantization_config=quantization,
                  device_map={"": _device()})
    if has_weights(folder):
        return AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    with tempfile.TemporaryDirectory(prefix="quantize-") as tmp:
        torch.manual_seed(seed)
        plain = AutoModelForCausalLM.from_config(config, dtype=DTYPES[precision], attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
        # written directly: save_pretrained writes only on rank 0 of a process group, and every
        # rank quantizes its own copy
        plain.config.save_pretrained(tmp)
        safetensors.torch.save_model(plain, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        del plain
        return AutoModelForCausalLM.from_pretrained(tmp, **kwargs)


def _import_model_class(config) -> None:
    """Import the model's class before a ZeRO-3 construction context is entered. deepspeed.zero.Init
    restores on exit the `__init__` that a class defined inside it had first, which drops what
    decorators put there afterwards (transformers' hub-kernel wrappers, when the `kernels` package
    is installed): a second ZeRO-3 model in the same process then fails in its first forward."""
    try:
        AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):  # a remote-code or unknown model: resolved by from_config itself
        pass


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameters; under ZeRO-3 the full (not partitioned) sizes. A model
    split by tensor or pipeline parallelism carries its whole model's counts (set when it was
    split, engine.assembly.root), so every rank reports the same numbers."""
    whole = getattr(model, "whole_model_parameters", None)
    if whole is not None:
        return whole
    total = trainable = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable
