"""The schema the front ends build their forms from: one entry per leaf field of the run config,
with a human label. A field added to contract.config.schema shows up in every form."""

from __future__ import annotations

import typing
from typing import Any

from pydantic.fields import FieldInfo

from contract.config.schema import RunConfig, Section
from contract.validation_words import choices


def schema() -> list[dict]:
    """One entry per leaf field: key, group, kind, default, label (a human name: the field's
    `label=`, else `field_label`), help, choices, minimum, maximum -- all read from the pydantic
    declaration in contract.config.schema."""
    entries = []
    for name, section in RunConfig.model_fields.items():
        tp = section.annotation
        if isinstance(tp, type) and issubclass(tp, Section):
            for key, f in tp.model_fields.items():
                entries.append(_entry(f"{name}.{key}", name, f))
        else:
            entries.append(_entry(name, "run", section))
    return entries


def _entry(key: str, group: str, f: FieldInfo) -> dict:
    tp: Any = f.annotation
    origin = typing.get_origin(tp)
    allowed = choices(tp)  # a Literal's or an Enum's values (method.name: contract.capabilities.Method)
    kind = ("choice" if allowed is not None else "list" if origin is list else
            {bool: "bool", int: "int", float: "float", str: "str", dict: "dict"}.get(tp, "str"))
    extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
    bounds = {type(m).__name__: m for m in f.metadata}
    return {"key": key, "group": group, "kind": kind, "default": f.get_default(call_default_factory=True),
            "label": extra.get("label") or field_label(key), "help": f.description or "",
            "choices": allowed,
            "minimum": getattr(bounds.get("Ge"), "ge", None), "maximum": getattr(bounds.get("Le"), "le", None)}


# words a field's name abbreviates, spelled out in its human label
_LABEL_WORDS = {"lr": "learning rate", "tp": "tensor parallel", "pp": "pipeline parallel", "dp": "data parallel",
                "nproc": "processes (ranks)", "grad": "gradient", "accum": "accumulation", "attn": "attention",
                "lora": "LoRA", "zero": "ZeRO", "eps": "epsilon", "n": "N", "max": "max", "num": "number of",
                "r": "rank", "tensorboard": "TensorBoard", "deepspeed": "DeepSpeed config (JSON)", "addr": "address"}


def field_label(key: str) -> str:
    """A field's human label from its name, where its declaration gives none (`label=`):
    `train.grad_accum` -> "Gradient accumulation"."""
    words = [_LABEL_WORDS.get(w, w) for w in key.rsplit(".", 1)[-1].split("_")]
    text = " ".join(words)
    return text[0].upper() + text[1:]


def get_value(config: RunConfig, key: str) -> Any:
    obj: Any = config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
