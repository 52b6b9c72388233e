"""Offline export: a saved checkpoint or adapter to a Hugging Face folder, in one process.

`python -m engine.checkpoint export SOURCE TARGET [--merge-lora] [--format gguf --dtype T]` (the
web app's Export and Merge buttons run this). SOURCE is one of

- a training checkpoint (`trainer_state.json` inside): the weights come from DeepSpeed's own
  layout -- `zero_to_fp32` for ZeRO 1-3, the model states file for ZeRO 0 -- into the model its
  run config describes (the same builder as the run, PEFT wrapping included);
- a PEFT adapter folder (`adapter_config.json`): loaded onto its base model folder with PEFT;
- a Hugging Face model folder: exported as it is (a copy in safetensors).

A whole model or adapter is written (transformers' / PEFT's `save_pretrained`, safetensors), with
the tokenizer; `--merge-lora` folds a LoRA adapter into the base weights first (PEFT's
`merge_and_unload`), giving a plain model. `--format gguf` writes a GGUF file for llama.cpp and Ollama instead, by
llama.cpp's own converter (engine.checkpoint.gguf), from the plain model (a LoRA adapter merged
first), with an Ollama Modelfile beside it. This runs on one process and holds the whole model in
memory once (in the run's precision), which is what an export needs and no training run has to
pay; a live run exports without stopping through the control plane's save instead.

Tensor- and pipeline-parallel checkpoints hold each rank's slice in DeepSpeed's own per-rank
files, which `zero_to_fp32` cannot merge: those are refused here with the way that works (save
the model from the live run, or DeepSpeed's universal checkpoint conversion).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from contract.exports import GGUF_TYPES
from engine.checkpoint import atomic, gguf
from engine.checkpoint.locations import CheckpointError
from engine.checkpoint import reading
from engine.checkpoint import locations

TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"


class ExportError(CheckpointError):
    pass


def export(source: str, target: str, merge_lora: bool = False, say: Callable[[str], None] = print,
           fmt: str = "hf", dtype: str = "f16") -> str:
    """Write SOURCE (see the module docstring) as a Hugging Face folder at TARGET (`fmt` "hf"), or
    as a GGUF file with its Ollama Modelfile (`fmt` "gguf", of type `dtype`); returns a line
    saying what was written. Nothing is written when anything is wrong."""
    src, dst = Path(source), Path(target)
    if not src.is_dir():
        raise ExportError(f"source: no such folder: {source}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ExportError(f"target: {target} exists and is not empty; choose a new folder")
    if fmt not in ("hf", "gguf"):
        raise ExportError(f"format: {fmt!r} is not one of hf, gguf")
    if fmt == "gguf":
        if dtype not in GGUF_TYPES:
            raise ExportError(f"dtype: {dtype!r} is not one of {', '.join(GGUF_TYPES)}")
        gguf.check_architecture(_config_folder(src))  # before any work
        gguf.check_tokenizer(_tokenizer_folder(src))
    if (src / TRAINER_STATE).exists():
        model, tokenizer, what = _from_training_checkpoint(src, say)
    elif (src / ADAPTER_CONFIG).exists():
        model, tokenizer, what = _from_adapter(src, say)
    elif (src / "config.json").exists():
        model, tokenizer, what = _from_model_folder(src, say)
    else:
        raise ExportError(f"source: {source} is neither a training checkpoint ({TRAINER_STATE}), "
                          f"an adapter folder ({ADAPTER_CONFIG}) nor a model folder (config.json)")
    from engine.model.methods import is_peft_model
    if merge_lora or (fmt == "gguf" and is_peft_model(model)):
        model = _merged(model, what)
        what += ", LoRA merged into the base weights"
    if fmt == "gguf":
        return _write_gguf(model, tokenizer, src, dst, dtype, what, say)
    kind = "adapter" if is_peft_model(model) else "model"
    say(f"writing the {kind} to {dst}")
    with atomic.writing(str(dst), kind=kind, meta={"exported_from": str(src)}) as w:
        model.save_pretrained(str(w.local), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(w.local))
    return f"exported {what} to {dst} as a Hugging Face {kind} folder"


def _write_gguf(model, tokenizer, src: Path, dst: Path, dtype: str, what: str, say) -> str:
    """The plain model through a Hugging Face folder (a temporary one) into GGUF, published with
    its Modelfile as one folder."""
    with tempfile.TemporaryDirectory(prefix="livetune-gguf-") as tmp:
        plain = Path(tmp) / "hf"
        model.save_pretrained(str(plain), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(plain))
        spm = gguf.sentencepiece_file(src, _config_folder(src))
        if spm is not None and not (plain / spm.name).exists():
            shutil.copy(spm, plain / spm.name)
        with atomic.writing(str(dst), kind="gguf", meta={"exported_from": str(src), "dtype": dtype}) as w:
            gguf.convert(plain, Path(w.local) / gguf.GGUF_FILE, dtype, say)
            (Path(w.local) / gguf.MODELFILE).write_text(gguf.modelfile(tokenizer) if tokenizer is not None
                                                        else f"FROM ./{gguf.GGUF_FILE}\n")
    return (f"exported {what} to {dst / gguf.GGUF_FILE} as GGUF ({dtype}), with an Ollama Modelfile "
            f"(ollama create NAME -f {dst / gguf.MODELFILE})")


def _tokenizer_folder(src: Path) -> Path:
    """Where SOURCE's tokenizer lies: SOURCE itself when it holds one, else its model's folder."""
    return src if (src / "tokenizer_config.json").exists() else _config_folder(src)


def _config_folder(src: Path) -> Path:
    """The folder whose config.json describes SOURCE's architecture (and may hold its
    SentencePiece tokenizer model): the run's model folder, the adapter's base, or SOURCE."""
    if (src / TRAINER_STATE).exists():
        from contract.config.load import load_config
        from engine.model.loading import model_dir_of
        saved = json.loads((src / TRAINER_STATE).read_text())["config"]
        return model_dir_of(load_config(data={**saved, "resume": "", "data": {**saved["data"], "train": "", "eval": ""},
                                              "parallel": {**saved["parallel"], "hostfile": ""}}))
    if (src / ADAPTER_CONFIG).exists():
        base = json.loads((src / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
        return Path(base)
    return src


# -- sources ----------------------------------------------------------------------------------------
def _from_training_checkpoint(src: Path, say):
    from contract.config.load import load_config
    from engine.model.methods import prepare_model
    from engine.model.loading import build_model, model_dir_of, tokenizer_of

    marker = reading.complete_marker(str(src), kind="training")
    say(f"checking {len(marker.get('files', {}))} files of {src.name}")
    problems = reading.verify(locations.location(str(src)), marker)
    if problems:
        raise ExportError(f"source: {src} is damaged, nothing exported: " + "; ".join(problems[:5]))
    record = json.loads((src / TRAINER_STATE).read_text())
    layout = record["layout"]
    if layout["tp_size"] > 1 or layout["pp_size"] > 1:
        raise ExportError(
            f"source: {src} was saved with tp_size {layout['tp_size']} x pp_size {layout['pp_size']}; "
            "its weights are split across per-rank files that this offline export cannot join. Save the "
            "model from the run itself (Save model in the app, or save_model), or convert it with "
            "DeepSpeed's ds_to_universal first")
    # the run's model and method only: its data files and resume point do not matter here
    saved = record["config"]
    cfg = load_config(data={**saved, "resume": "", "data": {**saved["data"], "train": "", "eval": ""},
                            "parallel": {**saved["parallel"], "hostfile": ""}})
    precision = record["model"]["precision"]
    say(f"building the model ({cfg.method.name}, {precision})")
    model = prepare_model(build_model(model_dir_of(cfg), seed=cfg.train.seed, precision="fp32",
                                      trust_remote_code=cfg.model.trust_remote_code), cfg)
    say(f"reading the weights of step {record['position']['global_step']} "
        f"(ZeRO stage {layout['zero_stage']})")
    state = _deepspeed_state(src, record["ds_tag"], layout["zero_stage"])
    _load_state(model, state, src)
    from engine.model.loading import DTYPES
    return model.to(DTYPES[precision]), tokenizer_of(cfg), \
        f"{src.name} (step {record['position']['global_step']})"


def _deepspeed_state(src: Path, tag: str, zero_stage: int) -> dict[str, torch.Tensor]:
    if zero_stage == 0:  # no ZeRO partitions: the module's own state dict is in the model file
        files = sorted((src / tag).glob("mp_rank_*_model_states.pt"))
        if not files:
            raise ExportError(f"source: {src / tag} has no model states file")
        return torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(src), tag=tag)


def _load_state(model: torch.nn.Module, state: dict, src: Path) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k and getattr(model.config, "tie_word_embeddings", False)}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ExportError(f"source: the weights in {src} do not fit the run's model: "
                          f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    if tied:
        model.tie_weights()


def _from_adapter(src: Path, say):
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from engine.model.loading import has_weights, load_tokenizer
    base_dir = Path(PeftConfig.from_pretrained(str(src)).base_model_name_or_path or "")
    if not base_dir.is_dir() or not has_weights(base_dir):
        raise ExportError(
            f"source: the adapter's base model ({base_dir or 'not named'}) is not a local folder with "
            "weights (the embedded default model is built from its seed and has none); export a "
            "training checkpoint of the run instead, which holds the base weights too")
    say(f"loading the base model {base_dir} and the adapter {src.name}")
    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    model = PeftModel.from_pretrained(base, str(src))
    tokenizer_dir = src if (src / "tokenizer_config.json").exists() else base_dir
    return model, load_tokenizer(tokenizer_dir), f"the adapter {src.name}"


def _from_model_folder(src: Path, say):
    from transformers import AutoModelForCausalLM

    from engine.model.loading import has_weights, load_tokenizer
    if not has_weights(src):
        raise ExportError(f"source: {src} has a config but no weights to export")
    say(f"loading {src}")
    tokenizer = load_tokenizer(src) if (src / "tokenizer_config.json").exists() else None
    return AutoModelForCausalLM.from_pretrained(str(src)), tokenizer, f"the model {src.name}"


def _merged(model, what: str):
    from engine.model.methods import is_peft_model
    if not is_peft_model(model):
        raise ExportError(f"--merge-lora: {what} has no adapter to merge (it trains the whole model); "
                          "export it without --merge-lora")
    kinds = {name: c.peft_type.value for name, c in model.peft_config.items()}
    if set(kinds.values()) != {"LORA"}:
        raise ExportError(f"--merge-lora: only LoRA adapters merge into the base weights; this one is "
                          f"{', '.join(sorted(set(kinds.values())))}: export the adapter without --merge-lora")
    return model.merge_and_unload()

