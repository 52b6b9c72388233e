"""The Configure tab: every run config field, grouped, generated from the schema; presets; YAML
load and save; previews (resolved config, DeepSpeed JSON after "auto" filling, launch command);
validation as the user types, each problem shown under its field, Start disabled while any; the
pre-flight check's warnings (dropped or truncated rows, the loud ones first) and where each value
comes from (the preset, the form, the schema's default), with a button that fits the settings to
the user's own model and data as the terminal does (`Form.for_own_model`); "Submit to Slurm"
beside Start (`app.web.slurm`)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr

from app.form import DEFAULT_PRESET, ENTRY_LISTS, Checked, Form, entries, entries_text
from contract.lm_eval_names import task_names
from app.web.access import OPERATOR, may_change
from app.web.backend import Backend
from app.web import slurm
from app.web.backend.preview import PreviewError
from app.web.field_notes import EVAL_KEYS, INSPECTED, LIMIT_KEYS, evaluation_off, field_note, idle_note
from app.web.widgets import problems_html, provenance_html, readable
from contract.presets import PRESETS
from contract.run_folder import RunFolder
from supervisor.launch import launch_command

COLUMNS = 3


@dataclass
class ConfigureTab:
    fields: dict[str, gr.components.Component]              # field key -> its component
    start_buttons: list[gr.Button] = field(default_factory=list)
    validation: Any = None                                 # the "check" outputs wiring, set by build()

    @property
    def inputs(self) -> set[gr.components.Component]:
        """Every field's component, as a set: a handler given it gets {component: value}."""
        return set(self.fields.values())

    def values(self, given: dict) -> dict[str, Any]:
        """The form's values by field key, from what Gradio hands a handler of `inputs`."""
        return {key: entries_text(given[component]) if key in ENTRY_LISTS else given[component]
                for key, component in self.fields.items()}

    def show(self, values: dict[str, Any]) -> dict:
        """Outputs that put `values` (by field key) into the fields."""
        return {self.fields[key]: entries(value) if key in ENTRY_LISTS else value
                for key, value in values.items() if key in self.fields}


def slug(key: str) -> str:
    return key.replace(".", "-").replace("_", "-")


def _help(f: dict, problems: list[str], warnings: list[str] | None = None) -> dict:
    """The props that show a field's problems: they lead its info line, which turns red (CSS
    class `invalid`); a JSON field has no info line, so its label carries them. The pre-flight
    check's `warnings` on the field follow them (amber, class `warned`: the run can start)."""
    warn = "⚠ " + "; ".join(problems) + " — " if problems else ""
    warn += "Warning: " + "; ".join(warnings) + " — " if warnings else ""
    classes = ["cfg-field", "invalid"] if problems else ["cfg-field", "warned"] if warnings else ["cfg-field"]
    if f["kind"] == "dict":
        return {"label": f"{warn}{Form.label(f)}", "elem_classes": classes}
    info = f["help"] + _bounds(f) + (f" {ENTRY_LISTS[f['key']]}" if f["key"] in ENTRY_LISTS else
                                     " Comma-separated." if f["kind"] == "list" else "")
    return {"info": warn + info, "elem_classes": classes}


def _component(f: dict, value: Any, problems: list[str], warnings: list[str] | None = None) -> gr.components.Component:
    """The widget of one schema field."""
    label, kind, elem_id = Form.label(f), f["kind"], f"cfg-{slug(f['key'])}"
    shown = _help(f, problems, warnings)
    info, classes = shown.get("info"), shown["elem_classes"]
    if kind == "dict":
        return gr.Code(value=value, language="json", label=shown["label"], lines=3, elem_id=elem_id,
                       elem_classes=classes)
    common = dict(label=label, info=info, elem_id=elem_id, elem_classes=classes)
    if f["key"] in ENTRY_LISTS:  # a list of entries, each typed and confirmed with Enter
        # the harness's task names to search among (a task YAML's path is typed as a custom value)
        offered = list(task_names() or ()) if f["key"] == "eval.lm_eval_tasks" else []
        return gr.Dropdown(choices=offered, value=entries(value), multiselect=True, allow_custom_value=True, **common)
    if kind == "bool":
        return gr.Checkbox(value=value, **common)
    if kind == "choice":
        return gr.Dropdown(choices=f["choices"], value=value, **common)
    if kind == "int":
        return gr.Number(value=value, precision=0, **common)
    if kind == "float":
        return gr.Number(value=value, step=_step(f["default"]), **common)
    return gr.Textbox(value=value, max_lines=1, **common)


def _bounds(f: dict) -> str:
    lo, hi = f["minimum"], f["maximum"]
    if lo is not None and hi is not None:
        return f" ({lo} to {hi})"
    return f" (at least {lo})" if lo is not None else (f" (at most {hi})" if hi is not None else "")


def _step(default: Any) -> float:
    if isinstance(default, (int, float)) and default > 0:
        return 10.0 ** math.floor(math.log10(default))
    return 0.01


def _section(common: list[dict], advanced: list[dict], values: dict[str, Any], first: Checked, inputs: dict,
             notes: dict, group: str) -> None:
    """One section: its common fields, then the rest in a closed "Advanced" fold."""
    _rows(common, values, first, inputs, notes)
    if advanced:
        names = ", ".join(f.get("label") or f["key"] for f in advanced)
        with gr.Accordion(f"Advanced ({len(advanced)}): {names}" if len(names) < 90 else
                          f"Advanced ({len(advanced)} more fields)", open=not common,
                          elem_id=f"cfg-advanced-{group}"):
            _rows(advanced, values, first, inputs, notes)


def _rows(fields: list[dict], values: dict[str, Any], first: Checked, inputs: dict, notes: dict) -> None:
    """Fields COLUMNS to a row (the row is the widgets' only wrapper: fewer components make the
    page load faster)."""
    for row in range(0, len(fields), COLUMNS):
        chunk = fields[row:row + COLUMNS]
        with gr.Row():
            for f in chunk:
                inputs[f["key"]] = _component(f, values[f["key"]], first.by_field.get(f["key"], []),
                                              first.warnings.get(f["key"]))
            for _ in range(COLUMNS - len(chunk)):  # a short last row keeps the column widths
                gr.HTML("")
        for f in chunk:
            if f["key"] in INSPECTED:
                notes[f["key"]] = gr.Markdown(idle_note(f["key"], values.get("preference.objective") or "sft"),
                                              elem_classes="inspect-note",
                                              elem_id=f"inspect-{slug(f['key'])}")


def build(backend: Backend, run_state: gr.State, tabs: gr.Tabs) -> ConfigureTab:
    form = backend.form
    values = form.preset_values(DEFAULT_PRESET)
    first = form.check(values)
    with gr.Row(equal_height=True):
        preset = gr.Dropdown(list(PRESETS), value=DEFAULT_PRESET, label="Preset", scale=3,
                             elem_id="cfg-preset", info="Fills every field; edit anything after.")
        load = gr.UploadButton("Load YAML", file_types=[".yaml", ".yml", ".json"], scale=1, elem_id="cfg-load")
        save = gr.DownloadButton("Save YAML", value=_yaml_file(form.to_yaml(values)), scale=1, elem_id="cfg-save")
        start = gr.Button("Start training", variant="primary", interactive=first.ok, scale=2, elem_id="cfg-start", elem_classes=[OPERATOR])
    slurm_fold = slurm.build(first.ok)
    summary = gr.HTML(_summary(form, first), elem_id="cfg-summary")
    first_origin, first_fits = provenance(form, values, DEFAULT_PRESET)
    with gr.Row(equal_height=True):
        origin = gr.HTML(first_origin, elem_id="cfg-provenance")
        fit = gr.Button("Fit the settings to my model and data", size="sm", visible=first_fits, scale=0,
                        min_width=220, elem_id="cfg-fit-own")
    fields: dict[str, gr.components.Component] = {}
    notes: dict[str, gr.Markdown] = {}
    # one sub-tab per section: the browser draws a tab's fields only when it is opened, which
    # keeps the page quick to load (the summary above names every problem, wherever it is)
    sections: dict[str, gr.Tab] = {}
    with gr.Tabs(elem_id="cfg-sections"):
        for group, title, common, advanced in form.sections():
            with gr.Tab(title, id=f"cfg-{group}", elem_id=f"cfg-group-{group}") as sections[group]:
                _section(common, advanced, values, first, fields, notes, group)
    with gr.Accordion("Preview: resolved run config, DeepSpeed config, launch command", open=False,
                      elem_id="cfg-preview") as preview_acc:
        with gr.Row():
            resolved = gr.Code(first.config.to_yaml() if first.ok else "", language="yaml",
                               label="Resolved run config", lines=16, interactive=False, elem_id="cfg-resolved")
            ds_json = gr.Code("", language="json", label="DeepSpeed config after \"auto\" filling",
                              lines=16, interactive=False, elem_id="cfg-ds-json")
        command = gr.Code(_command(backend, first), language="shell", label="Launch command", lines=2,
                          interactive=False, elem_id="cfg-command")
        ds_button = gr.Button("Resolve the DeepSpeed config", size="sm", elem_id="cfg-ds-button")

    tab = ConfigureTab(fields, [start, slurm_fold.button])
    shown = gr.State(_marks(first))  # the problems and warnings this page shows under its fields
    yaml_path = gr.State(None)  # the YAML file this page offers last wrote (removed when replaced)

    def check(given: dict) -> dict:
        values = tab.values(given)
        checked = form.check(values)
        origin_html, fits = provenance(form, values, given[preset])
        before = given[shown]
        # only the fields whose problems changed are sent: a field being typed in stays as it is
        now = _marks(checked)
        marks = {fields[f["key"]]: gr.update(**_help(f, *now.get(f["key"], ([], []))))
                 for f in form.fields if now.get(f["key"]) != before.get(f["key"])}
        written = _yaml_file(form.to_yaml(values), given[yaml_path])
        return {shown: now, **marks, yaml_path: written,
                summary: _summary(form, checked), origin: origin_html, fit: gr.update(visible=fits),
                **{b: gr.update(interactive=checked.ok and may_change(backend)) for b in tab.start_buttons},
                resolved: checked.config.to_yaml() if checked.ok else "# fix the problems above first",
                command: _command(backend, checked), save: written}

    def wire_validation() -> None:
        outputs = [shown, yaml_path, *fields.values(), summary, origin, fit, *tab.start_buttons, resolved,
                   command, save]
        gr.on([preset.change, *(c.change for c in fields.values())], check,
              inputs={shown, yaml_path, preset, *fields.values()},
              outputs=outputs, trigger_mode="always_last", show_progress="hidden", api_visibility="private")

    tab.validation = wire_validation  # wired by the app once every Start button exists

    preset.input(readable(lambda name: tab.show(form.preset_values(name))), inputs=preset,
                 outputs=list(fields.values()), api_visibility="private")
    load.upload(readable(lambda path: tab.show(_load_yaml(form, path))), inputs=load,
                outputs=list(fields.values()), api_visibility="private")
    deepspeed = readable(lambda given: _deepspeed(backend, tab.values(given)))
    ds_button.click(deepspeed, inputs=tab.inputs, outputs=ds_json, api_visibility="private")
    preview_acc.expand(deepspeed, inputs=tab.inputs, outputs=ds_json, api_visibility="private")
    objective = fields["preference.objective"]

    def own_data(given: dict) -> dict:
        """Training data entered: the evaluation schedule off when there is nothing to evaluate
        on (said under data.eval)."""
        values = tab.values(given)
        changes, note = evaluation_off(values)
        if note:
            gr.Info("Evaluation switched off: your training data comes without evaluation data.")
        out = {fields[k]: v for k, v in changes.items()}
        if note:
            out[notes["data.eval"]] = note
        return out or {notes["data.eval"]: gr.update()}

    fields["data.train"].change(readable(own_data), inputs=tab.inputs,
                                outputs=[*(fields[k] for k in EVAL_KEYS), notes["data.eval"]],
                                trigger_mode="always_last", show_progress="hidden", api_visibility="private")
    for key, note in notes.items():
        component, fmt = fields[key], fields["data.format"]
        judged_by = [fmt, objective, *(fields[k] for k in LIMIT_KEYS)]
        show = readable(lambda path, f, o, *limits, k=key: field_note(backend, k, path, f, o, *limits))
        wiring = dict(inputs=[component, *judged_by], outputs=note, trigger_mode="always_last",
                      show_progress="minimal", api_visibility="private")
        component.change(show, **wiring)
        if key == "data.train":  # its rows follow what judges them; the embedded task's rows come when
            # its section is opened (no file to wait for: the note is filled once somebody looks)
            gr.on([c.change for c in judged_by] + [sections[_group(form, key)].select], show, **wiring)
        elif key == "data.eval":  # a file's rows follow the limits; empty, the note stays as it is
            # (it may say that evaluation was switched off)
            gr.on([c.change for c in judged_by if c is not objective],
                  lambda path, *rest, show=show: show(path, *rest) if str(path or "").strip() else gr.update(),
                  **wiring)
    start.click(readable(lambda given: start_run(backend, tab.values(given), run_state, tabs)),
                inputs=tab.inputs, outputs=[run_state, tabs], api_visibility="private")
    slurm_fold.button.click(
        readable(lambda given: slurm.submit_run(backend, tab.values(given), slurm_fold.values(given), run_state, tabs)),
        inputs={*tab.inputs, *slurm_fold.inputs}, outputs=[run_state, tabs], api_visibility="private")
    fit.click(readable(lambda given: fit_own(form, tab, tab.values(given), given[preset])),
              inputs={preset, *tab.inputs}, outputs=list(fields.values()), api_visibility="private")
    return tab


def _marks(checked: Checked) -> dict[str, tuple[list[str], list[str]]]:
    """(problems, warnings) by field: what the page shows under each field."""
    keys = set(checked.by_field) | set(checked.warnings)
    return {k: (checked.by_field.get(k, []), checked.warnings.get(k, [])) for k in keys}


def provenance(form: Form, values: dict[str, Any], preset: str) -> tuple[str, bool]:
    """Where each value on the form comes from (HTML), and whether a run with the user's own
    model or data would start from other values (`Form.for_own_model`: the Fit button shows)."""
    sources = form.sources(values, preset)
    titles = {"form": "set on this form", "preset": f"from the preset {preset!r}"}
    by_source = {title: [f"{key}={_short(values.get(key))}" for key, found in sources.items() if found == kind]
                 for kind, title in titles.items()}
    own = form.for_own_model(values, preset)
    fitted = [f"{key} {_short(values.get(key))} → {_short(own[key])}" for key in form.keys
              if own.get(key) != values.get(key)]
    return provenance_html(by_source, fitted), bool(fitted)


def fit_own(form: Form, tab: ConfigureTab, values: dict[str, Any], preset: str) -> dict:
    """The Fit button: the values a run with the user's own model or data starts from."""
    own = form.for_own_model(values, preset)
    changed = [key for key in form.keys if own.get(key) != values.get(key)]
    gr.Info("Fitted: " + ", ".join(f"{k} = {_short(own[k])}" for k in changed) if changed else
            "Nothing to fit: no own model or data, or another preset.")
    return tab.show({key: own[key] for key in changed}) or {tab.fields["model.path"]: gr.update()}


def _short(value: Any, width: int = 40) -> str:
    text = str(value) if value not in (None, "") else "''"
    return text if len(text) <= width else text[:width - 1] + "…"


def _summary(form: Form, checked: Checked) -> str:
    """The summary box: every problem, or the pre-flight check's warnings, by section › field."""
    report = checked.preflight
    if report is None or checked.problems:
        return problems_html(_all_problems(form, checked))
    titles = {f["key"]: title for _, title, fields in form.groups() for f in fields}

    def named(findings: list[tuple[str, str]]) -> list[str]:
        return [f"{titles.get(form.owner(k) or '', 'Config')} › {k}: {m}" for k, m in findings]
    return problems_html([], named(report.warnings), named(report.loud))


def start_run(backend: Backend, values: dict[str, Any], run_state: gr.State, tabs: gr.Tabs) -> dict:
    """Start button: validate, start, then show the Train tab following the new run."""
    checked = backend.form.check(values)
    if checked.config is None:
        raise gr.Error("The config has problems; fix them first:\n" + "\n".join(_all_problems(backend.form, checked)),
                       print_exception=False)
    info = backend.session.start(checked.config)
    gr.Info(f"Started {info.name}; the ranks are starting up.")
    return {run_state: info.path, tabs: gr.Tabs(selected="train")}


def _all_problems(form: Form, checked: Checked) -> list[str]:
    """Every problem, with the section (sub-tab) of the field it names."""
    titles = {f["key"]: title for _, title, fields in form.groups() for f in fields}
    return [f"{titles.get(form.owner(k) or '', 'Config')} › {k}: {m}" for k, m in checked.problems]


def _command(backend: Backend, checked: Checked) -> str:
    cfg = checked.config
    if cfg is None:
        return "# fix the problems above first"
    name = cfg.logging.run_name or "<run name>"
    folder = RunFolder(Path(cfg.logging.output_dir or backend.output_dir) / name)
    return shlex.join(launch_command(cfg, folder))


def _yaml_file(text: str, previous: str | None = None) -> str:
    """The file "Save YAML" offers: named by its content (the same config, the same file), and
    the page's `previous` one removed when it is replaced (Gradio has served its own copy of it
    by then), so validating as the user types leaves one file per page, not one per check."""
    folder = Path(tempfile.gettempdir()) / "livetune-configs"
    folder.mkdir(exist_ok=True)
    path = folder / f"run-config-{hashlib.sha256(text.encode()).hexdigest()[:16]}.yaml"
    if not path.exists():
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(text)
        part.replace(path)
    if previous and previous != str(path) and Path(previous).parent == folder:
        Path(previous).unlink(missing_ok=True)
    return str(path)


def _load_yaml(form: Form, path: str) -> dict[str, Any]:
    try:
        values, notes = form.load_yaml(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise gr.Error(f"Cannot load {Path(path).name}: {e}", print_exception=False) from None
    if notes:
        gr.Warning("Not taken from the file: " + "; ".join(notes))
    else:
        gr.Info(f"Loaded {Path(path).name}")
    return values


def _deepspeed(backend: Backend, values: dict[str, Any]) -> str:
    checked = backend.form.check(values)
    if checked.config is None:
        return "// fix the config's problems first"
    try:
        answer = backend.preview.deepspeed(checked.config.to_dict())
    except PreviewError as e:
        return f"// {e}"
    if not answer.get("ok"):
        return "// " + "\n// ".join(str(answer.get("error", "the preview failed")).splitlines())
    head = f"// precision {answer['precision']}, {answer['total_steps']} steps"
    head += " (estimated from the data)" if answer.get("total_steps_estimated") else ""
    warnings = "".join(f"\n// warning: {w}" for w in answer.get("warnings", []))
    return head + warnings + "\n" + json.dumps(answer["config"], indent=2)


def _group(form: Form, key: str) -> str:
    """The section (sub-tab) a field is in."""
    return next(group for group, _, common, advanced in form.sections()
                if any(f["key"] == key for f in common + advanced))
