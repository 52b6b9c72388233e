"""A run config from a command line: `[CONFIG.yaml] [key=value ...]`, as `./launch.sh train`
takes it, and where each setting came from.

Which base a command line starts from:

- neither a config file nor a model (model.path) nor data (data.train): the embedded default's
  preset (contract.presets.DEFAULT: its tiny model, its task, its measured hyperparameters);
- a model or data of the user's own (named in the overrides or the file): the schema's defaults,
  never that preset (its max_length 32, its evaluation every 100 steps, its 1000 steps and its
  learning rate fit the tiny default task, not a real model). data.max_length, unless given, is
  the model's own context length (max_position_embeddings, GPT-2's n_positions) capped at
  contract.model_facts.CONTEXT_CAP; evaluation is scheduled only where evaluation data is given;
- a config file: the file over the schema's defaults (max_length fitted as above when it
  names a model or data of the user's own).

`resolve_args` also says, for every field, where its value came from: the config file, an
override, the preset, the model, or the schema's default; the terminal prints it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from contract import presets
from contract.config.schema import RunConfig, SHORTCUTS
from contract.config.form import get_value, schema
from contract.config.load import load_config
from contract.model_facts import CONTEXT_CAP, ModelFolderProblem, context_length, read_model_config

FROM_FILE, FROM_OVERRIDE, FROM_PRESET, FROM_MODEL, FROM_DEFAULT = (
    "config file", "override", "preset", "model", "default")
PRESET_NAME = "embedded default"


@dataclass
class Resolved:
    """A validated config and, for every schema field, where its value came from."""
    config: RunConfig
    sources: dict[str, str]   # field key -> FROM_FILE | FROM_OVERRIDE | FROM_PRESET | FROM_MODEL | FROM_DEFAULT
    reasons: dict[str, str]   # field key -> why (for FROM_MODEL)

    def provenance(self) -> str:
        """Lines saying what came from where (every field not listed: the schema's default)."""
        order = (FROM_FILE, FROM_OVERRIDE, FROM_PRESET, FROM_MODEL)
        titles = {FROM_FILE: "from the config file", FROM_OVERRIDE: "from the command line",
                  FROM_PRESET: f"from the preset {PRESET_NAME!r}", FROM_MODEL: "fitted to the model"}
        lines = []
        for source in order:
            keys = [k for k, s in self.sources.items() if s == source]
            if keys:
                shown = ", ".join(f"{k}={_short(get_value(self.config, k))}"
                                  + (f" ({self.reasons[k]})" if k in self.reasons else "") for k in keys)
                lines.append(f"{titles[source]}: {shown}")
        lines.append("every other field: the schema's default")
        return "\n".join(lines)


def config_from_args(args: list[str]) -> RunConfig:
    """The first argument without `=` is the config file; every other one is an override
    (dotted field name or short name, `key=value`). Raises ConfigError naming every problem."""
    return resolve_args(args).config


def resolve_args(args: list[str]) -> Resolved:
    """config_from_args, plus where each field's value came from."""
    config_path, overrides = _split(args)
    file_keys = _file_keys(config_path)
    override_keys = {SHORTCUTS.get(k.strip(), k.strip()) for k, _, _ in (o.partition("=") for o in overrides)}
    given = file_keys | override_keys
    given_values = _given_values(config_path, overrides)
    own = {k: v for k, v in given_values.items() if k in ("model.path", "data.train", "data.sources")}
    uses_preset = config_path is None and not any(own.values())
    # the embedded default's GRPO variant has its own preset (contract.presets.GRPO_DEFAULT)
    preset = presets.GRPO_DEFAULT if given_values.get("preference.objective") == "grpo" else presets.DEFAULT
    base: dict | None = copy.deepcopy(preset) if uses_preset else None
    reasons: dict[str, str] = {}
    if any(own.values()) and "data.max_length" not in given:
        fitted = fitted_max_length(own.get("model.path") or "")
        if fitted is not None:
            base = {"data": {"max_length": fitted[0]}}
            reasons["data.max_length"] = fitted[1]
    config = load_config(config_path, overrides, data=base)
    preset_keys = _flat_keys(preset) if uses_preset else set()
    sources = {}
    for entry in schema():
        key = entry["key"]
        sources[key] = (FROM_OVERRIDE if _names(override_keys, key) else FROM_FILE if _names(file_keys, key)
                        else FROM_MODEL if key in reasons else FROM_PRESET if key in preset_keys
                        else FROM_DEFAULT)
    return Resolved(config, {k: s for k, s in sources.items() if s != FROM_DEFAULT}, reasons)


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    config_path: str | None = None
    overrides: list[str] = []
    for arg in args:
        if "=" not in arg and config_path is None:
            config_path = arg
        else:
            overrides.append(arg)
    return config_path, overrides


def _file_raw(config_path: str | None) -> dict:
    if not config_path:
        return {}
    try:
        raw = yaml.safe_load(Path(config_path).read_text())
    except (OSError, yaml.YAMLError):
        return {}  # load_config reports it
    return raw if isinstance(raw, dict) else {}


def _file_keys(config_path: str | None) -> set[str]:
    return _flat_keys(_file_raw(config_path))


def _given_values(config_path: str | None, overrides: list[str]) -> dict[str, Any]:
    """The values of model.path, data.train (or data.sources) and preference.objective as the file
    and the overrides give them."""
    raw = _file_raw(config_path)
    values = {k: _dig(raw, k) for k in ("model.path", "data.train", "data.sources", "preference.objective")}
    for item in overrides:
        key, _, value = item.partition("=")
        key = SHORTCUTS.get(key.strip(), key.strip())
        if key in values:
            values[key] = value.strip()
    return values


def fitted_max_length(model_path: str) -> tuple[int, str] | None:
    """(max_length, why) for a user's run: the model's context capped at CONTEXT_CAP."""
    if model_path:
        try:
            context = context_length(read_model_config(Path(model_path).expanduser()))
        except ModelFolderProblem:
            return None  # the pre-flight check names the folder's problem
        where = "the model's config.json"
    else:
        context, where = presets.MODEL_SIZE["positions"], "the embedded default model"
    if context is None:
        return min(CONTEXT_CAP, 512), f"{where} gives no context length; {min(CONTEXT_CAP, 512)}"
    if context > CONTEXT_CAP:
        return CONTEXT_CAP, f"{where} allows {context} positions, capped at {CONTEXT_CAP}"
    return context, f"the context length of {where}"


def _flat_keys(data: Any, prefix: str = "") -> set[str]:
    if not isinstance(data, dict):
        return set()
    keys: set[str] = set()
    for k, v in data.items():
        key = f"{prefix}{k}"
        keys.add(key)
        keys |= _flat_keys(v, key + ".")
    return keys


def _names(keys: set[str], field_key: str) -> bool:
    """Whether `keys` set the field (itself, or a part of a mapping field)."""
    return field_key in keys or any(k.startswith(field_key + ".") for k in keys)


def _dig(raw: dict, key: str) -> Any:
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
