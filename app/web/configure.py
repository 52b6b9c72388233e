"""The Configure tab: every run config field, grouped, generated from the schema; presets; YAML
load and save; previews (resolved config, DeepSpeed JSON after "auto" filling, launch command);
validation as the user types, each problem shown under its field, Start disabled while any."""

from __future__ import annotations

import math
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr

from app.web.backend import Backend
from app.web.backend.forms import DEFAULT_PRESET, Checked
from app.web.backend.preview import describe_data, describe_model
from app.web.widgets import problems_html, readable
from supervisor.launch import launch_command
from contract.presets import PRESETS
from contract.run_folder import RunFolder

INSPECTED = {"model.path": "model", "data.train": "data", "data.eval": "data"}
COLUMNS = 3


@dataclass
class ConfigureTab:
    inputs: list[gr.components.Component]                 # one per schema field, in schema order
    start_buttons: list[gr.Button] = field(default_factory=list)
    validation: Any = None                                 # the "check" outputs wiring, set by wire()


def slug(key: str) -> str:
    return key.replace(".", "-").replace("_", "-")


def _help(f: dict, problems: list[str]) -> dict:
    """The props that show a field's problems: they lead its info line, which turns red (CSS
    class `invalid`); a JSON field has no info line, so its label carries them."""
    warn = "⚠ " + "; ".join(problems) + " — " if problems else ""
    classes = ["cfg-field", "invalid"] if problems else ["cfg-field"]
    if f["kind"] == "dict":
        return {"label": f"{warn}{f['key'].rsplit('.', 1)[-1]} (JSON)", "elem_classes": classes}
    info = f["help"] + _bounds(f) + (" Comma-separated." if f["kind"] == "list" else "")
    return {"info": warn + info, "elem_classes": classes}


def _component(f: dict, value: Any, problems: list[str]) -> gr.components.Component:
    """The widget of one schema field."""
    label, kind, elem_id = f["key"].rsplit(".", 1)[-1], f["kind"], f"cfg-{slug(f['key'])}"
    shown = _help(f, problems)
    info, classes = shown.get("info"), shown["elem_classes"]
    if kind == "dict":
        return gr.Code(value=value, language="json", label=shown["label"], lines=3, elem_id=elem_id,
                       elem_classes=classes)
    common = dict(label=label, info=info, elem_id=elem_id, elem_classes=classes)
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


def _section(form, fields: list[dict], values: list, first: Checked, inputs: list, notes: dict) -> None:
    """One section's fields, COLUMNS to a row (the row is the widgets' only wrapper: fewer
    components make the page load faster)."""
    for row in range(0, len(fields), COLUMNS):
        chunk = fields[row:row + COLUMNS]
        with gr.Row():
            for f in chunk:
                inputs.append(_component(f, values[form.keys.index(f["key"])], first.by_field.get(f["key"], [])))
            for _ in range(COLUMNS - len(chunk)):  # a short last row keeps the column widths
                gr.HTML("")
        for f in chunk:
            if f["key"] in INSPECTED:
                notes[f["key"]] = gr.Markdown(_idle_note(f["key"]), elem_classes="inspect-note",
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
        start = gr.Button("Start training", variant="primary", interactive=first.ok, scale=2, elem_id="cfg-start")
    summary = gr.HTML(problems_html(_all_problems(form, first)), elem_id="cfg-summary")
    inputs, notes = [], {}
    # one sub-tab per section: the browser draws a tab's fields only when it is opened, which
    # keeps the page quick to load (the summary above names every problem, wherever it is)
    with gr.Tabs(elem_id="cfg-sections"):
        for group, title, fields in form.groups():
            with gr.Tab(title, id=f"cfg-{group}", elem_id=f"cfg-group-{group}"):
                _section(form, fields, values, first, inputs, notes)
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

    tab = ConfigureTab(inputs, [start])
    shown = gr.State(first.by_field)  # the problems this page shows under its fields

    def check(before: dict, *vals: Any):
        checked = form.check(list(vals))
        # only the fields whose problems changed are sent: a field being typed in stays as it is
        marks = [gr.update(**_help(f, checked.by_field.get(f["key"], [])))
                 if checked.by_field.get(f["key"]) != before.get(f["key"]) else gr.skip()
                 for f in form.fields]
        start_state = [gr.update(interactive=checked.ok) for _ in tab.start_buttons]
        return (checked.by_field, *marks, problems_html(_all_problems(form, checked)), *start_state,
                checked.config.to_yaml() if checked.ok else "# fix the problems above first",
                _command(backend, checked), _yaml_file(form.to_yaml(list(vals))))

    def outputs() -> list:
        return [shown, *inputs, summary, *tab.start_buttons, resolved, command, save]

    def wire_validation() -> None:
        gr.on([c.change for c in inputs], check, inputs=[shown, *inputs], outputs=outputs(),
              trigger_mode="always_last", show_progress="hidden", api_visibility="private")

    tab.validation = wire_validation  # wired by the app once every Start button exists

    preset.input(readable(form.preset_values), inputs=preset, outputs=inputs, api_visibility="private")
    load.upload(readable(lambda path: _load_yaml(form, path)), inputs=load, outputs=inputs,
                api_visibility="private")
    ds_button.click(readable(lambda *v: _deepspeed(backend, list(v))), inputs=inputs, outputs=ds_json,
                    api_visibility="private")
    preview_acc.expand(readable(lambda *v: _deepspeed(backend, list(v))), inputs=inputs, outputs=ds_json,
                       api_visibility="private")
    for key, note in notes.items():
        component = inputs[form.keys.index(key)]
        fmt = inputs[form.keys.index("data.format")]
        component.change(readable(lambda path, f, k=key: _inspect(backend, k, path, f)),
                         inputs=[component, fmt], outputs=note, trigger_mode="always_last",
                         show_progress="minimal", api_visibility="private")
    start.click(readable(lambda *v: start_run(backend, list(v))), inputs=inputs,
                outputs=[run_state, tabs], api_visibility="private")
    return tab


def start_run(backend: Backend, values: list[Any]):
    """Start button: validate, start, then show the Train tab following the new run."""
    checked = backend.form.check(values)
    if not checked.ok:
        raise gr.Error("The config has problems; fix them first:\n" + "\n".join(_all_problems(backend.form, checked)),
                       print_exception=False)
    info = backend.start(checked.config)
    gr.Info(f"Started {info.name}; the ranks are starting up.")
    return info.path, gr.Tabs(selected="train")


def _all_problems(form, checked: Checked) -> list[str]:
    """Every problem, with the section (sub-tab) of the field it names."""
    titles = {f["key"]: title for _, title, fields in form.groups() for f in fields}
    return [f"{titles.get(form.owner(k) or '', 'Config')} › {k}: {m}" for k, m in checked.problems]


def _command(backend: Backend, checked: Checked) -> str:
    if not checked.ok:
        return "# fix the problems above first"
    cfg = checked.config
    name = cfg.logging.run_name or "<run name>"
    folder = RunFolder(Path(cfg.logging.output_dir or backend.output_dir) / name)
    return shlex.join(launch_command(cfg, folder))


def _yaml_file(text: str) -> str:
    folder = Path(tempfile.gettempdir()) / "livetune-configs"
    folder.mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="run-config-", dir=folder, delete=False) as f:
        f.write(text)
    return f.name


def _load_yaml(form, path: str) -> list[Any]:
    try:
        values, notes = form.load_yaml(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise gr.Error(f"Cannot load {Path(path).name}: {e}", print_exception=False) from None
    if notes:
        gr.Warning("Not taken from the file: " + "; ".join(notes))
    else:
        gr.Info(f"Loaded {Path(path).name}")
    return values


def _deepspeed(backend: Backend, values: list[Any]) -> str:
    import json
    checked = backend.form.check(values)
    if not checked.ok:
        return "// fix the config's problems first"
    answer = backend.preview_deepspeed(checked.config)
    if not answer.get("ok"):
        return "// " + "\n// ".join(str(answer.get("error", "failed")).splitlines())
    head = f"// precision {answer['precision']}, {answer['total_steps']} steps"
    head += " (estimated from the data)" if answer.get("total_steps_estimated") else ""
    warnings = "".join(f"\n// warning: {w}" for w in answer.get("warnings", []))
    return head + warnings + "\n" + json.dumps(answer["config"], indent=2)


def _idle_note(key: str) -> str:
    if key == "model.path":
        return "Empty: the embedded tiny Llama (2 layers, hidden 128, character tokenizer)."
    if key == "data.train":
        return "Empty: the embedded synthetic task (reverse / sort / upper a word)."
    return "Empty: the default task's held-out split, or no evaluation data."


def _inspect(backend: Backend, key: str, path: str, fmt: str) -> str:
    path = (path or "").strip()
    if not path:
        return _idle_note(key)
    if not Path(path).exists():
        return f"**Cannot use it:** no such {'folder' if key == 'model.path' else 'file or folder'}: `{path}`"
    if INSPECTED[key] == "model":
        return describe_model(backend.inspect_model(path))
    return describe_data(backend.inspect_data(path, fmt or "auto"))
