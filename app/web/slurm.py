"""The Configure tab's "Submit to Slurm" fold, beside Start: the job's options (the fields of
`supervisor.slurm.SlurmOptions`, the same as `./launch.sh submit --slurm` takes) and a button that
submits the form's run through `Session.submit`, the terminal's code path. The run then shows on
the Train tab as queued until Slurm starts the job, then as it runs; Stop cancels the job."""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from typing import Any

import gradio as gr

from app.web.access import OPERATOR
from app.web.backend import Backend
from supervisor.slurm import SlurmOptions

# what each option means, as its field's info line says it (the names are SlurmOptions')
HELP = {"nodes": "Machines for the job.",
        "procs_per_node": "Ranks per machine; 0: the config's parallel.nproc.",
        "gpus_per_node": "GPUs asked for on each machine; 0: none asked for.",
        "cpus_per_task": "Cores for each machine's ranks; 0: Slurm's default.",
        "partition": "Slurm partition (queue); empty: the cluster's default.",
        "time": "Time limit, e.g. 2:00:00; empty: the partition's default.",
        "account": "Account to charge; empty: your default."}


@dataclass
class SlurmFold:
    """The fold's components: one per SlurmOptions field, the note and the submit button."""
    fields: dict[str, gr.components.Component]
    note: gr.Markdown
    button: gr.Button

    @property
    def inputs(self) -> set[gr.components.Component]:
        return set(self.fields.values())

    def values(self, given: dict) -> dict[str, Any]:
        """The options as typed, by SlurmOptions field name."""
        return {name: given[component] for name, component in self.fields.items()}


def build(interactive: bool) -> SlurmFold:
    """The fold (closed); `interactive`: whether the form is valid (the button follows Start)."""
    with gr.Accordion("Submit to Slurm instead (a cluster's batch queue)", open=False, elem_id="cfg-slurm"):
        note = gr.Markdown(availability(), elem_id="cfg-slurm-note")
        fields: dict[str, gr.components.Component] = {}
        defaults = SlurmOptions()
        with gr.Row():
            for f in dataclasses.fields(SlurmOptions):
                value, elem_id = getattr(defaults, f.name), f"cfg-slurm-{f.name.replace('_', '-')}"
                label = f.name.replace("_", " ").capitalize()
                if isinstance(value, int):
                    fields[f.name] = gr.Number(value, precision=0, minimum=0, label=label, info=HELP[f.name],
                                               elem_id=elem_id, min_width=120)
                else:
                    fields[f.name] = gr.Textbox(value, label=label, info=HELP[f.name], max_lines=1,
                                                elem_id=elem_id, min_width=120)
        button = gr.Button("Submit to Slurm", interactive=interactive, elem_id="cfg-slurm-submit", elem_classes=[OPERATOR])
    return SlurmFold(fields, note, button)


def availability() -> str:
    """Whether this machine can submit (sbatch on the PATH), and what a submitted run needs."""
    sbatch = shutil.which("sbatch")
    where = (f"`sbatch` found ({sbatch})." if sbatch else
             "**`sbatch` is not installed here:** run the app on a machine of the Slurm cluster to submit.")
    return (f"{where} The job script and the job id go into the run folder, which must be on a file "
            "system the compute nodes share with this machine; the run shows as *queued* until Slurm "
            "starts it, then as it runs (chat, pause, set lr work as for a run started here). Stop "
            "cancels the job. Terminal: `./launch.sh submit CONFIG.yaml --slurm`.")


def options(values: dict[str, Any]) -> SlurmOptions:
    """SlurmOptions from the fold's values; a gr.Error naming each bad field."""
    found: dict[str, Any] = {}
    problems = []
    for f in dataclasses.fields(SlurmOptions):
        value, default = values.get(f.name), getattr(SlurmOptions(), f.name)
        if isinstance(default, int):
            try:
                number = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                number = float("nan")
            if not number.is_integer():
                problems.append(f"{f.name}: a whole number, got {value!r}")
                continue
            found[f.name] = int(number)
        else:
            text = str(value or "").strip()
            if any(c.isspace() for c in text):
                problems.append(f"{f.name}: no spaces, got {text!r}")
            found[f.name] = text
    opts = SlurmOptions(**found) if not problems else None
    if opts is not None:
        try:
            opts.check()
        except ValueError as e:
            problems.append(str(e))
    if problems or opts is None:
        raise gr.Error("Submit to Slurm: " + "; ".join(problems), print_exception=False)
    return opts


def submit_run(backend: Backend, values: dict[str, Any], slurm_values: dict[str, Any],
               run_state: gr.State, tabs: gr.Tabs) -> dict:
    """The Submit button: check the form as Start does, submit, then show the Train tab following
    the run (queued first)."""
    checked = backend.form.check(values)
    if checked.config is None:
        raise gr.Error("The config has problems; fix them first:\n" +
                       "\n".join(f"{k}: {m}" for k, m in checked.problems), print_exception=False)
    opts = options(slurm_values)
    info = backend.session.submit(checked.config, opts, checked=checked.preflight)
    gr.Info(f"Submitted {info.name} to Slurm; it is {info.state} until the job starts.")
    return {run_state: info.path, tabs: gr.Tabs(selected="train")}
