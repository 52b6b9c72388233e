"""The Configure form as data: one entry per run config field, taken from `contract.config.schema()`,
so the form cannot drift from the schema. Converts between the values the form widgets hold
(numbers, text, check boxes) and the nested config dict, and validates through `load_config`,
keeping each problem next to the field it names. Knows nothing of layout."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from contract.config import ConfigError, RunConfig, load_config, schema
from contract.presets import PRESETS

DEFAULT_PRESET = "embedded default"

# Section titles as the page shows them; a section the schema gains later gets its own name.
GROUP_TITLES = {"model": "Model", "data": "Data", "method": "Method", "optim": "Optimization",
                "train": "Training", "parallel": "Parallelism and DeepSpeed", "eval": "Evaluation",
                "checkpoint": "Checkpoints", "logging": "Logging", "control": "Control socket",
                "run": "Resume"}


@dataclass
class Checked:
    """The outcome of validating the form: a config when there is no problem."""
    config: RunConfig | None
    problems: list[tuple[str, str]]                          # every problem, as load_config names it
    by_field: dict[str, list[str]] = field(default_factory=dict)  # field key -> its messages
    general: list[str] = field(default_factory=list)          # problems naming no field of the form

    @property
    def ok(self) -> bool:
        return self.config is not None


class Form:
    """The run config's fields in schema order; `output_dir` is the app's runs folder."""

    def __init__(self, output_dir: str):
        self.fields = schema()
        for f in self.fields:
            if f["key"] == "logging.output_dir":
                f["default"] = output_dir
        self.keys = [f["key"] for f in self.fields]
        self._by_key = {f["key"]: f for f in self.fields}

    def groups(self) -> list[tuple[str, str, list[dict]]]:
        """(group, title, fields) in schema order."""
        order = list(dict.fromkeys(f["group"] for f in self.fields))
        return [(g, GROUP_TITLES.get(g, g.replace("_", " ").title()),
                 [f for f in self.fields if f["group"] == g]) for g in order]

    def field(self, key: str) -> dict:
        return self._by_key[key]

    # -- values <-> config dict -------------------------------------------------------------------
    def values_for(self, data: dict | None = None) -> list[Any]:
        """Widget values (in `keys` order) of the schema defaults with `data` (nested) on top."""
        return [self.display(f, _dotted_get(data or {}, f["key"], f["default"])) for f in self.fields]

    def preset_values(self, name: str) -> list[Any]:
        if name not in PRESETS:
            raise KeyError(f"no preset {name!r}; presets: {', '.join(PRESETS)}")
        return self.values_for(copy.deepcopy(PRESETS[name]))

    @staticmethod
    def display(f: dict, value: Any) -> Any:
        """A config value as its widget holds it."""
        if f["kind"] == "list":
            return ", ".join(str(v) for v in value) if isinstance(value, list) else str(value)
        if f["kind"] == "dict":
            return json.dumps(value, indent=2) if value else ""
        return value

    def to_data(self, values: list[Any]) -> tuple[dict, list[tuple[str, str]]]:
        """The nested config dict the widget values say, and the values that cannot be read."""
        data: dict = {}
        problems: list[tuple[str, str]] = []
        for f, value in zip(self.fields, values):
            key, kind = f["key"], f["kind"]
            if kind in ("int", "float") and (value is None or value == ""):
                problems.append((key, "needs a value"))
                continue
            if kind == "dict":
                value = _parse_mapping(key, value, problems)
                if value is None:
                    continue
            if kind == "int" and isinstance(value, float) and value.is_integer():
                value = int(value)
            _dotted_set(data, key, value)
        return data, problems

    def check(self, values: list[Any]) -> Checked:
        """Validate the widget values: every problem, each kept next to the field it names."""
        data, problems = self.to_data(values)
        config = None
        try:
            config = load_config(data=data)
        except ConfigError as e:
            problems += [p for p in e.problems if p[0] not in {k for k, _ in problems}]
        if problems:
            config = None
        return self._sort(config, problems)

    def _sort(self, config: RunConfig | None, problems: list[tuple[str, str]]) -> Checked:
        checked = Checked(config, problems)
        for key, message in problems:
            owner = self.owner(key)
            if owner is None:
                checked.general.append(f"{key}: {message}")
            else:
                shown = message if owner == key else f"{key}: {message}"
                checked.by_field.setdefault(owner, []).append(shown)
        return checked

    def owner(self, key: str) -> str | None:
        """The form field a problem belongs to (`parallel.deepspeed.x` belongs to
        `parallel.deepspeed`); None for one that names no field."""
        while key:
            if key in self._by_key:
                return key
            key = key.rpartition(".")[0]
        return None

    # -- YAML -------------------------------------------------------------------------------------
    def load_yaml(self, text: str) -> tuple[list[Any], list[str]]:
        """Widget values from a YAML config, and notes on what the form could not take."""
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"a run config is a mapping of sections, not {type(raw).__name__}")
        notes = []
        try:
            load_config(data=copy.deepcopy(raw))
        except ConfigError as e:
            notes = [f"{k}: {m}" for k, m in e.problems if self.owner(k) is None]
        return self.values_for(raw), notes

    def to_yaml(self, values: list[Any]) -> str:
        """The form as a YAML run config (resolved when valid, else as typed)."""
        checked = self.check(values)
        if checked.ok:
            return checked.config.to_yaml()
        return yaml.safe_dump(self.to_data(values)[0], sort_keys=False)


def _parse_mapping(key: str, text: Any, problems: list[tuple[str, str]]) -> dict | None:
    if isinstance(text, dict):
        return text
    if text is None or not str(text).strip():
        return {}
    try:
        value = yaml.safe_load(str(text))  # JSON is YAML too
    except yaml.YAMLError as e:
        problems.append((key, f"not valid JSON or YAML: {str(e).splitlines()[0]}"))
        return None
    if not isinstance(value, dict):
        problems.append((key, f"expected a mapping (a JSON object), got {value!r}"))
        return None
    return value


def _dotted_get(data: dict, key: str, default: Any) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _dotted_set(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for part in parts[:-1]:
        data = data.setdefault(part, {})
    data[parts[-1]] = value
