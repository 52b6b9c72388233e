"""The run config form, generated from `contract.config.schema()`: one widget per field, one tab
per section, and the very messages `load_config` gives (its ConfigError problems) shown next to
the fields at fault. A field added to the schema shows up here with no change to this file.

    form = ConfigForm()                # filled with the embedded default preset
    form.set("train.max_steps", 50)
    cfg = form.config()                # RunConfig, or ConfigError naming every field at fault
"""

from __future__ import annotations

import copy
import html
from typing import Any

import ipywidgets as widgets
import yaml

from contract.config import ConfigError, RunConfig, load_config, schema
from contract.presets import PRESETS

SCHEMA_DEFAULTS = "schema defaults"
DEFAULT_PRESET = "embedded default"

_ERROR_STYLE = "color:#b00020;font-size:90%"
_HELP_STYLE = "color:#666;font-size:85%"


def _field_widget(entry: dict) -> widgets.ValueWidget:
    """The widget for one schema entry (kinds: choice, bool, int, float, str, list, dict)."""
    name, kind = entry["key"].rsplit(".", 1)[-1], entry["kind"]
    common = {"description": name, "style": {"description_width": "150px"},
              "tooltip": entry["help"], "layout": widgets.Layout(width="420px")}
    if kind == "choice":
        return widgets.Dropdown(options=entry["choices"], **common)
    if kind == "bool":
        return widgets.Checkbox(indent=True, **common)
    # plain number boxes, not bounded ones: an out-of-range value must reach load_config and get
    # its message, not be clamped silently by the widget
    if kind == "int":
        return widgets.IntText(**common)
    if kind == "float":
        return widgets.FloatText(**common)
    if kind == "dict":
        return widgets.Textarea(placeholder="YAML or JSON mapping", continuous_update=False, **common)
    placeholder = "comma separated" if kind == "list" else ""
    return widgets.Text(placeholder=placeholder, continuous_update=False, **common)


def _to_widget(kind: str, value: Any) -> Any:
    """A config value as its widget holds it (lists as comma separated text, mappings as YAML);
    text given for such a field is taken as it is."""
    if isinstance(value, str) and kind in ("list", "dict"):
        return value
    if kind == "list":
        return ", ".join(str(v) for v in value)
    if kind == "dict":
        return yaml.safe_dump(value, sort_keys=False).strip() if value else ""
    return value


def flatten(nested: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"max_steps": 5}} -> {"train.max_steps": 5} (dict-valued fields stay whole)."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted != "parallel.deepspeed":
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


class ConfigForm:
    """A form over the run config schema. `widgets[key]` is the widget of field `key`."""

    def __init__(self, preset: str | None = DEFAULT_PRESET, validate_live: bool = True):
        self.entries = {e["key"]: e for e in schema()}
        self.widgets: dict[str, widgets.ValueWidget] = {k: _field_widget(e) for k, e in self.entries.items()}
        self.errors: dict[str, widgets.HTML] = {k: widgets.HTML() for k in self.entries}
        self.summary = widgets.HTML()
        self.problems: list[tuple[str, str]] = []
        self.preset = widgets.Dropdown(options=[SCHEMA_DEFAULTS, *PRESETS], description="preset",
                                       value=preset or SCHEMA_DEFAULTS)
        self._quiet = False
        self.reset(preset)
        self.preset.observe(lambda change: self.reset(change["new"]), names="value")
        if validate_live:
            for w in self.widgets.values():
                w.observe(self._on_change, names="value")
        self.widget = widgets.VBox([self.preset, self._tabs(), self.summary])

    def _tabs(self) -> widgets.Tab:
        groups: dict[str, list[widgets.Widget]] = {}
        for key, entry in self.entries.items():
            row = widgets.VBox([
                widgets.HBox([self.widgets[key],
                              widgets.HTML(f"<span style='{_HELP_STYLE}'>{html.escape(entry['help'])}</span>",
                                           layout=widgets.Layout(width="520px"))]),
                self.errors[key]])
            groups.setdefault(entry["group"], []).append(row)
        tabs = widgets.Tab(children=[widgets.VBox(rows) for rows in groups.values()])
        for i, group in enumerate(groups):
            tabs.set_title(i, group)
        return tabs

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    # -- values -------------------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        """Put a config value (a list, a dict, a number ...) into field `key`'s widget."""
        if key not in self.widgets:
            raise KeyError(f"no field {key!r} in the run config; fields: {', '.join(self.entries)}")
        self.widgets[key].value = _to_widget(self.entries[key]["kind"], value)

    def get(self, key: str) -> Any:
        return self.widgets[key].value

    def update(self, values: dict) -> None:
        """Set several fields from a nested dict (a preset, a config's to_dict())."""
        for key, value in flatten(values).items():
            self.set(key, value)

    def reset(self, preset: str | None = DEFAULT_PRESET) -> None:
        """Every field to its schema default, then the preset's values on top."""
        self._quiet = True
        try:
            for key, entry in self.entries.items():
                self.set(key, copy.deepcopy(entry["default"]))
            if preset and preset != SCHEMA_DEFAULTS:
                self.update(PRESETS[preset])
        finally:
            self._quiet = False
        self.validate()

    def load(self, config: RunConfig) -> None:
        """Show an existing config (e.g. the one a run was started with)."""
        self._quiet = True
        try:
            self.update(config.to_dict())
        finally:
            self._quiet = False
        self.validate()

    def raw(self) -> tuple[dict, list[tuple[str, str]]]:
        """The nested dict the widgets hold, and the problems of fields that cannot be read at
        all (a mapping field that is not YAML)."""
        data: dict[str, Any] = {}
        problems = []
        for key, entry in self.entries.items():
            value = self.widgets[key].value
            if entry["kind"] == "dict":
                try:
                    value = yaml.safe_load(value) if value.strip() else {}
                except yaml.YAMLError as e:
                    problems.append((key, f"not valid YAML or JSON: {str(e).splitlines()[0]}"))
                    continue
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return data, problems

    def config(self) -> RunConfig:
        """The validated RunConfig; ConfigError (every problem, as load_config words it) if not."""
        data, problems = self.raw()
        try:
            cfg = load_config(data=data)
        except ConfigError as e:
            problems += e.problems
        if problems:
            raise ConfigError(problems)
        return cfg

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> list[tuple[str, str]]:
        """Check the form now; show each problem next to its field; returns the problems."""
        try:
            self.config()
            self.problems = []
        except ConfigError as e:
            self.problems = list(e.problems)
        by_field: dict[str, list[str]] = {}
        for key, message in self.problems:
            by_field.setdefault(key, []).append(message)
        for key, label in self.errors.items():
            messages = by_field.get(key, [])
            label.value = "".join(f"<div style='{_ERROR_STYLE};margin-left:155px'>{html.escape(m)}</div>"
                                  for m in messages)
        if self.problems:
            items = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(m)}</li>" for k, m in self.problems)
            self.summary.value = (f"<div style='{_ERROR_STYLE}'>invalid run config ({len(self.problems)} "
                                  f"problem{'s' * (len(self.problems) != 1)}):<ul>{items}</ul></div>")
        else:
            self.summary.value = "<span style='color:#2e7d32'>config is valid</span>"
        return self.problems

    def _on_change(self, change: dict) -> None:
        if not self._quiet:
            self.validate()
