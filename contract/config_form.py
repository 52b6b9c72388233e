"""The schema the front ends build their forms from: one entry per leaf field of the run config,
with a human label. A field added to contract.config_schema shows up in every form."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from contract.config_schema import RunConfig


def schema() -> list[dict]:
    """One entry per leaf field: key, group, kind, default, label (a human name: the field's
    `label=`, else `field_label`), help, choices, minimum, maximum."""
    entries = []
    hints = typing.get_type_hints(RunConfig)
    for section in dataclasses.fields(RunConfig):
        tp = hints[section.name]
        if dataclasses.is_dataclass(tp):
            sub_hints = typing.get_type_hints(tp)
            for f in dataclasses.fields(tp):
                entries.append(_entry(f"{section.name}.{f.name}", section.name, f, sub_hints[f.name]))
        else:
            entries.append(_entry(section.name, "run", section, tp))
    return entries


def _entry(key: str, group: str, f: dataclasses.Field, tp: Any) -> dict:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    origin = typing.get_origin(tp)
    kind = ("choice" if origin is Literal else "list" if origin is list else
            {bool: "bool", int: "int", float: "float", str: "str", dict: "dict"}.get(tp, "str"))
    return {"key": key, "group": group, "kind": kind, "default": default,
            "label": f.metadata.get("label") or field_label(key), "help": f.metadata.get("help", ""),
            "choices": list(typing.get_args(tp)) if origin is Literal else None,
            "minimum": f.metadata.get("minimum"), "maximum": f.metadata.get("maximum")}


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
