"""The run config form as widgets: one widget per field of the shared, layout-free `app.form.Form`
(the web app's Configure tab uses the same one), one tab per section, and the very messages
`load_config` gives (its ConfigError problems) shown next to the fields at fault. A field added to
the schema shows up here with no change to this file.

    form = ConfigForm()                # filled with the embedded default preset
    form.set("train.max_steps", 50)
    cfg = form.config()                # RunConfig, or ConfigError naming every field at fault
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from app.form import DEFAULT_PRESET, ENTRY_LISTS, SCHEMA_DEFAULTS, Form, entries, entries_text
from app.notebook.fallback import with_note
from contract.config.schema import RunConfig
from contract.presets import PRESETS

_ERROR_STYLE = "color:#b00020;font-size:90%"
_HELP_STYLE = "color:#666;font-size:85%"
# ipywidgets gives every tab the same 144 px and shrinks them to fit one row, cutting the titles
# ("Optimizat", "Parallelis"): the sections' tabs take their titles' widths and wrap onto more rows
TABS_CLASS = "lt-form-tabs"
PAGE_STYLE = f"""<style>
.{TABS_CLASS} > .lm-TabBar, .{TABS_CLASS} > .p-TabBar {{ height: auto !important; overflow: visible !important; }}
.{TABS_CLASS} > .lm-TabBar .lm-TabBar-content, .{TABS_CLASS} > .p-TabBar .p-TabBar-content {{ flex-wrap: wrap; }}
.{TABS_CLASS} > .lm-TabBar .lm-TabBar-tab, .{TABS_CLASS} > .p-TabBar .p-TabBar-tab {{ flex: 0 0 auto !important; max-width: none !important; }}
</style>"""


def _field_widget(entry: dict) -> widgets.ValueWidget:
    """The widget for one schema entry (kinds: choice, bool, int, float, str, list, dict)."""
    name, kind = entry.get("label") or entry["key"], entry["kind"]
    common = {"description": name, "style": {"description_width": "180px"},
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
    if entry["key"] in ENTRY_LISTS:  # a list of entries, each typed and confirmed with Enter
        return widgets.TagsInput(value=[], allow_duplicates=False, **common)
    placeholder = "comma separated" if kind == "list" else ""
    return widgets.Text(placeholder=placeholder, continuous_update=False, **common)


class ConfigForm:
    """Widgets over the shared form (`self.form`). `widgets[key]` is the widget of field `key`;
    `output_dir` is the default of logging.output_dir."""

    def __init__(self, preset: str | None = DEFAULT_PRESET, validate_live: bool = True,
                 output_dir: str | None = None):
        self.form = Form(output_dir)
        self.entries = {f["key"]: f for f in self.form.fields}
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
        # the style rides along in an HTML widget: a notebook takes no page CSS from a kernel otherwise
        self.widget = widgets.VBox([widgets.HTML(PAGE_STYLE), self.preset, self._tabs(), self.summary])

    def _row(self, f: dict) -> widgets.VBox:
        """A field: its widget (labelled with its human name), its config key and help beside it."""
        text = f"<code>{html.escape(f['key'])}</code> · {html.escape(f['help'])}"
        if f["key"] in ENTRY_LISTS:
            text += f" {html.escape(ENTRY_LISTS[f['key']])}"
        return widgets.VBox([widgets.HBox([self.widgets[f["key"]],
                                           widgets.HTML(f"<span style='{_HELP_STYLE}'>{text}</span>",
                                                        layout=widgets.Layout(width="520px"))]),
                             self.errors[f["key"]]])

    def _tabs(self) -> widgets.Tab:
        """One tab per section: its common fields, then the others in a closed "Advanced" fold."""
        pages = []
        for _, title, common, advanced in self.form.sections():
            rows: list[widgets.Widget] = [self._row(f) for f in common]
            if advanced:
                fold = widgets.Accordion(children=[widgets.VBox([self._row(f) for f in advanced])],
                                         selected_index=None if common else 0)
                fold.set_title(0, f"Advanced ({len(advanced)})")
                rows.append(fold)
            pages.append((title, widgets.VBox(rows)))
        tabs = widgets.Tab(children=[page for _, page in pages])
        tabs.add_class(TABS_CLASS)
        for i, (title, _) in enumerate(pages):
            tabs.set_title(i, title)
        return tabs

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return with_note(self.widget._repr_mimebundle_(**kwargs), "config form")

    # -- values -------------------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        """Put a config value (a list, a dict, a number ...) into field `key`'s widget."""
        self._put(key, self.form.display(self.form.field(key), value))

    def get(self, key: str) -> Any:
        return self.widgets[key].value

    def values(self) -> dict[str, Any]:
        """Every widget's value, by field key (what `app.form.Form` takes)."""
        return {key: entries_text(w.value) if key in ENTRY_LISTS else w.value for key, w in self.widgets.items()}

    def update(self, values: dict) -> None:
        """Set several fields from a nested dict (a preset, a config's to_dict())."""
        self._show(self.form.flat(values))

    def reset(self, preset: str | None = DEFAULT_PRESET) -> None:
        """Every field to its schema default, then the preset's values on top."""
        self._quiet = True
        try:
            self._show(self.form.preset_values(preset or SCHEMA_DEFAULTS))
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

    def _show(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            self._put(key, value)

    def _put(self, key: str, value: Any) -> None:
        """A widget value in Form's convention into field `key`'s widget (an entry list's as entries)."""
        self.widgets[key].value = entries(value) if key in ENTRY_LISTS else value

    def raw(self) -> tuple[dict, list[tuple[str, str]]]:
        """The nested dict the widgets hold, and the problems of fields that cannot be read at
        all (a mapping field that is not YAML)."""
        return self.form.to_data(self.values())

    def config(self) -> RunConfig:
        """The validated RunConfig; ConfigError (every problem, as load_config words it) if not."""
        return self.form.config(self.values())

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> list[tuple[str, str]]:
        """Check the form now; show each problem next to its field; returns the problems."""
        checked = self.form.check(self.values())
        self.problems = list(checked.problems)
        for key, label in self.errors.items():
            label.value = "".join(f"<div style='{_ERROR_STYLE};margin-left:185px'>{html.escape(m)}</div>"
                                  for m in checked.by_field.get(key, []))
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
