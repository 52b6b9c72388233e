"""The run config form as data, shared by the web app and the notebook: one entry per run config
field, taken from `contract.config.form.schema()`, so no front end can drift from the schema or from
the other. Knows nothing of layout: a front end keeps one widget per field key and hands this
module the widgets' values keyed by field (`{"train.max_steps": 50, ...}`).

    form = Form(output_dir="runs")
    values = form.preset_values("embedded default")   # {field key: widget value}
    values["train.max_steps"] = 50
    checked = form.check(values)                       # a RunConfig, or every problem by field

Also the two ways a config is given as text or data: `make_config` (a RunConfig, a dict, a YAML
file or None, then `key=value` overrides) and `config_from_text` (YAML laid over a preset).
Paths are made absolute by `contract.config.load.load_config` itself (fsspec URLs stay URLs).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from contract.args import fitted_max_length
from contract.config.schema import ConfigError, RunConfig
from contract.config.load import load_config, merge
from contract.config.form import schema
from contract.preflight import PreflightReport, preflight
from contract.presets import DEFAULT, PRESETS

DEFAULT_PRESET = "embedded default"
SCHEMA_DEFAULTS = "schema defaults"  # the "preset" of no preset: every field at its default

# Section titles as the pages show them; a section the schema gains later gets its own name.
GROUP_TITLES = {"model": "Model", "data": "Data", "method": "Method", "optim": "Optimization",
                "train": "Training", "parallel": "Parallelism and DeepSpeed", "eval": "Evaluation",
                "checkpoint": "Checkpoints", "logging": "Logging", "control": "Control socket",
                "preference": "Objective (SFT or preferences)", "run": "Resume"}
# Sections shown right after another one rather than in schema order: the objective (SFT, DPO, ...)
# is chosen with the method.
SHOWN_AFTER = {"preference": "method"}

# The fields most runs set, most used first in each section; the others of a section go into its
# "Advanced" fold (both front ends). A section with none of these shows only its fold.
COMMON = ("model.path", "data.train", "data.eval", "data.format", "data.max_length",
          "method.name", "method.lora_r", "method.lora_alpha", "method.lora_target_modules",
          "preference.objective", "preference.beta",
          "optim.lr", "optim.scheduler", "optim.warmup_steps", "optim.warmup_ratio", "optim.weight_decay",
          "train.max_steps", "train.epochs", "train.micro_batch_size", "train.grad_accum",
          "train.precision", "train.seed",
          "parallel.nproc", "parallel.zero_stage", "parallel.tp_size", "parallel.pp_size",
          "eval.every_n_steps", "eval.at_end", "eval.evaluators", "eval.lm_eval_tasks",
          "checkpoint.every_n_steps", "checkpoint.keep_last", "checkpoint.save_at_end",
          "logging.run_name", "logging.output_dir", "resume")

# Text-list fields both front ends show as a list of entries (typed one at a time) rather than
# comma-separated text, with what an entry may be. Their values stay text in Form's convention
# ("a, b"): `entries` and `entries_text` convert at the widget.
ENTRY_LISTS = {
    "eval.lm_eval_tasks": "One entry per task, typed and confirmed with Enter: a task name (arc_easy, "
                          "hellaswag) or a local task YAML's path (tasks/my_task.yaml, its data files "
                          "named inside it). Results are plotted with the other evaluation metrics.",
}


def entries(text: Any) -> list[str]:
    """A list field's widget text ("a, b") as its entries."""
    if isinstance(text, (list, tuple)):
        return [str(v).strip() for v in text if str(v).strip()]
    return [v.strip() for v in str(text or "").split(",") if v.strip()]


def entries_text(values: Any) -> str:
    """Entries as the widget text Form works with."""
    return ", ".join(entries(values))


_MISSING = object()


@dataclass
class Checked:
    """The outcome of validating the form: a config when there is no problem."""
    config: RunConfig | None
    problems: list[tuple[str, str]]                               # every problem, as load_config names it
    by_field: dict[str, list[str]] = field(default_factory=dict)  # field key -> its messages
    general: list[str] = field(default_factory=list)              # problems naming no field of the form
    # the pre-flight check's findings that do not refuse the run (dropped rows, truncation), by
    # field; `loud` the ones to show prominently (more than 10% of a file's rows truncated)
    warnings: dict[str, list[str]] = field(default_factory=dict)
    loud: list[str] = field(default_factory=list)
    preflight: PreflightReport | None = None

    @property
    def ok(self) -> bool:
        return self.config is not None


class Form:
    """The run config's fields in schema order; `output_dir` (if given) is the default of
    `logging.output_dir`, the folder the front end keeps its runs in."""

    def __init__(self, output_dir: str | None = None):
        self.fields = schema()
        if output_dir is not None:
            for f in self.fields:
                if f["key"] == "logging.output_dir":
                    f["default"] = output_dir
        self.keys = [f["key"] for f in self.fields]
        self._by_key = {f["key"]: f for f in self.fields}

    def groups(self) -> list[tuple[str, str, list[dict]]]:
        """(group, title, fields) in schema order, but for SHOWN_AFTER's sections."""
        present = list(dict.fromkeys(f["group"] for f in self.fields))
        order = [g for g in present if g not in SHOWN_AFTER]
        for group, after in SHOWN_AFTER.items():
            if group in present:
                order.insert(order.index(after) + 1 if after in order else len(order), group)
        return [(g, GROUP_TITLES.get(g, g.replace("_", " ").title()),
                 [f for f in self.fields if f["group"] == g]) for g in order]

    def sections(self) -> list[tuple[str, str, list[dict], list[dict]]]:
        """(group, title, common fields (COMMON's order), advanced fields (schema order))."""
        rank = {key: i for i, key in enumerate(COMMON)}
        return [(group, title, sorted((f for f in fields if f["key"] in rank), key=lambda f: rank[f["key"]]),
                 [f for f in fields if f["key"] not in rank]) for group, title, fields in self.groups()]

    @staticmethod
    def label(f: dict) -> str:
        """A field's label as the forms show it: its human name and its config key,
        "Micro batch size (train.micro_batch_size)"."""
        return f"{f.get('label') or f['key']} ({f['key']})"

    def field(self, key: str) -> dict:
        """The schema entry of field `key`; KeyError naming the fields when there is none."""
        if key not in self._by_key:
            raise KeyError(f"no field {key!r} in the run config; fields: {', '.join(self.keys)}")
        return self._by_key[key]

    # -- values <-> config dict -------------------------------------------------------------------
    def values_for(self, data: dict | None = None) -> dict[str, Any]:
        """Widget values of the schema defaults with `data` (a nested config dict) on top."""
        return {f["key"]: self.display(f, _dotted_get(data or {}, f["key"], copy.deepcopy(f["default"])))
                for f in self.fields}

    def preset_values(self, name: str) -> dict[str, Any]:
        """Widget values of preset `name` (SCHEMA_DEFAULTS or "": no preset)."""
        if not name or name == SCHEMA_DEFAULTS:
            return self.values_for()
        if name not in PRESETS:
            raise KeyError(f"no preset {name!r}; presets: {', '.join(PRESETS)}")
        return self.values_for(copy.deepcopy(PRESETS[name]))

    def flat(self, data: dict) -> dict[str, Any]:
        """Widget values of only the fields `data` (nested) names: {"train": {"max_steps": 5}}
        -> {"train.max_steps": 5}; a mapping field (parallel.deepspeed) stays whole."""
        found = {}
        for f in self.fields:
            value = _dotted_get(data, f["key"], _MISSING)
            if value is not _MISSING:
                found[f["key"]] = self.display(f, value)
        return found

    @staticmethod
    def display(f: dict, value: Any) -> Any:
        """A config value as its widget holds it: lists as comma-separated text, mappings as
        JSON text (which is YAML too); text given for such a field is kept as it is."""
        if isinstance(value, str) and f["kind"] in ("list", "dict"):
            return value
        if f["kind"] == "list":
            return ", ".join(str(v) for v in value) if isinstance(value, list) else str(value)
        if f["kind"] == "dict":
            return json.dumps(value, indent=2) if value else ""
        return value

    def to_data(self, values: Mapping[str, Any]) -> tuple[dict, list[tuple[str, str]]]:
        """The nested config dict the widget values say (fields missing from `values` keep their
        defaults), and the problems of values that cannot be read at all."""
        data: dict = {}
        problems: list[tuple[str, str]] = []
        for f in self.fields:
            key, kind = f["key"], f["kind"]
            if key not in values:
                continue
            value = values[key]
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

    def check(self, values: Mapping[str, Any], files: bool = True) -> Checked:
        """Validate the widget values: every problem, each kept next to the field it names.
        `files`: also run the pre-flight check (contract.preflight: the model folder, every data
        file, the DeepSpeed config after "auto" filling), as Start does; its problems make the
        config None (Start stays disabled) and its warnings come in `warnings` / `loud`."""
        data, problems = self.to_data(values)
        config = None
        try:
            config = load_config(data=data)
        except ConfigError as e:
            problems += [p for p in e.problems if p[0] not in {k for k, _ in problems}]
        if problems:
            config = None
        report = preflight(config) if files and config is not None else None
        if report is not None:
            problems += report.problems
            config = config if report.ok else None
        checked = self._sort(config, problems)
        if report is not None:
            checked.preflight = report
            for key, message in [*report.loud, *report.warnings]:
                checked.warnings.setdefault(self.owner(key) or key, []).append(message)
            checked.loud = [f"{key}: {message}" for key, message in report.loud]
        return checked

    def sources(self, values: Mapping[str, Any], preset: str = DEFAULT_PRESET) -> dict[str, str]:
        """Where each field's value came from, for the preview: "preset" (the value `preset`
        sets), "form" (set on the form, differing from the preset and the default) or "default"."""
        base = self.preset_values(preset)
        defaults = self.values_for()
        preset_keys = set(self.flat(PRESETS.get(preset, {}))) if preset in PRESETS else set()
        out = {}
        for key in self.keys:
            value = values.get(key, base[key])
            out[key] = ("preset" if key in preset_keys and value == base[key] else
                        "default" if value == defaults[key] else "form")
        return out

    def for_own_model(self, values: Mapping[str, Any], preset: str = DEFAULT_PRESET) -> dict[str, Any]:
        """The values a run with the user's own model or data starts from: the
        embedded default preset's values that were not changed on the form go back to the
        schema's defaults, and data.max_length (unless changed) becomes the model's context
        capped at contract.model_facts.CONTEXT_CAP. Values without an own model or data (or
        with another preset) come back unchanged."""
        out = dict(values)
        if preset != DEFAULT_PRESET or not (values.get("model.path") or values.get("data.train")):
            return out
        defaults = self.values_for()
        for key, source in self.sources(values, preset).items():
            if source == "preset":
                out[key] = defaults[key]
        if self.sources(values, preset).get("data.max_length") != "form":
            fitted = fitted_max_length(str(values.get("model.path") or ""))
            if fitted is not None:
                out["data.max_length"] = fitted[0]
        return out

    def config(self, values: Mapping[str, Any]) -> RunConfig:
        """The validated RunConfig; ConfigError naming every problem if there is any."""
        checked = self.check(values)
        if checked.config is None:
            raise ConfigError(checked.problems)
        return checked.config

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
    def load_yaml(self, text: str) -> tuple[dict[str, Any], list[str]]:
        """Widget values from a YAML config, and notes on what the form could not take."""
        raw = _mapping(text)
        notes = []
        try:
            load_config(data=copy.deepcopy(raw))
        except ConfigError as e:
            notes = [f"{k}: {m}" for k, m in e.problems if self.owner(k) is None]
        return self.values_for(raw), notes

    def to_yaml(self, values: Mapping[str, Any]) -> str:
        """The form as a YAML run config (resolved when valid, else as typed)."""
        checked = self.check(values)
        if checked.config is not None:
            return checked.config.to_yaml()
        return yaml.safe_dump(self.to_data(values)[0], sort_keys=False)


# -- configs from code and text -------------------------------------------------------------------

def make_config(config: RunConfig | dict | str | Path | None = None, *overrides: str) -> RunConfig:
    """A validated RunConfig from a RunConfig, a nested dict, a YAML file, or None (the embedded
    default preset), then `key=value` overrides (`max_steps=50`, `optim.lr=1e-4`). Raises
    ConfigError naming every field at fault."""
    if isinstance(config, RunConfig):
        return load_config(data=config.to_dict(), overrides=list(overrides))
    if config is None:
        return load_config(data=copy.deepcopy(DEFAULT), overrides=list(overrides))
    if isinstance(config, dict):
        return load_config(data=copy.deepcopy(config), overrides=list(overrides))
    return load_config(config, list(overrides))


def config_from_text(text: str = "", preset: str = DEFAULT_PRESET, output_dir: str | None = None) -> RunConfig:
    """A RunConfig from YAML (or JSON) text, a partial run config laid over `preset` ("" for the
    schema defaults). Raises ConfigError naming every problem (a bad preset or text included)."""
    if preset and preset != SCHEMA_DEFAULTS and preset not in PRESETS:
        raise ConfigError([("preset", f"no preset {preset!r}; presets: {', '.join(PRESETS)}")])
    try:
        data = _mapping(text)
    except ValueError as e:
        raise ConfigError([("config", str(e))]) from None
    form = Form(output_dir)
    base = form.to_data(form.preset_values(preset))[0]
    merge(base, data)
    return load_config(data=base)


def _mapping(text: str) -> dict:
    try:
        raw = yaml.safe_load(text) if text and text.strip() else {}
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML or JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"a run config is a mapping of sections, not {type(raw).__name__}")
    return raw


def _parse_mapping(key: str, text: Any, problems: list[tuple[str, str]]) -> dict | None:
    if isinstance(text, dict):
        return text
    if text is None or not str(text).strip():
        return {}
    try:
        value = yaml.safe_load(str(text))  # JSON is YAML too
    except yaml.YAMLError as e:
        problems.append((key, f"not valid YAML or JSON: {str(e).splitlines()[0]}"))
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
