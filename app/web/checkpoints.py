"""The Checkpoints tab: what the page's run saved (step, metrics, size); resume a new run from a
checkpoint; export a model or adapter; merge a LoRA adapter into its base model; export a GGUF
file for llama.cpp / Ollama (engine/checkpoint/gguf.py); the run's
branches, with Rewind, Branch and Snapshot (`app.web.branches`)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import pandas as pd

from app.session import SessionError
from app.web.access import OPERATOR, may_change
from app.web import branches
from app.web.backend import Backend
from app.web.widgets import TABLE_CLASS, readable
from contract.exports import GGUF_TYPES

# each column's share of the table's width (given, not measured from the cells: a measured path
# column pushed the table past the page's edge and squeezed the headers into "ste p")
COLUMNS = {"name": "11%", "kind": "8%", "step": "6%", "loss": "7%", "eval metrics": "20%", "size": "8%",
           "complete": "9%", "path": "31%"}


def build(backend: Backend, run_state: gr.State, tabs: gr.Tabs) -> dict:
    about = gr.Markdown("", elem_id="ckpt-about")
    table = gr.Dataframe(pd.DataFrame(columns=list(COLUMNS)), interactive=False, elem_id="ckpt-table",
                         wrap=True, max_height=320, column_widths=list(COLUMNS.values()), elem_classes=[TABLE_CLASS])
    with gr.Row(equal_height=True):
        chosen = gr.Dropdown([], label="Checkpoint, model or adapter", scale=3, elem_id="ckpt-choice",
                             allow_custom_value=False)
        refresh_btn = gr.Button("Refresh", scale=1, elem_id="ckpt-refresh")
    with gr.Row(equal_height=True):
        resume = gr.Button("Resume a new run from it", variant="primary", elem_id="ckpt-resume", elem_classes=[OPERATOR],
                           interactive=False)
        target = gr.Textbox(label="Export into (a new folder)", scale=2, elem_id="ckpt-target",
                            placeholder="e.g. exports/my-model")
        export = gr.Button("Export model / adapter", elem_id="ckpt-export", elem_classes=[OPERATOR])
        merge = gr.Button("Merge LoRA and export", elem_id="ckpt-merge", elem_classes=[OPERATOR])
    with gr.Row(equal_height=True):
        gguf_type = gr.Dropdown(list(GGUF_TYPES), value="f16", label="GGUF type", scale=1, elem_id="ckpt-gguf-type",
                                info="f32 and f16 keep the weights; q8_0 halves f16's size for a little accuracy")
        gguf = gr.Button("Export GGUF (llama.cpp / Ollama)", scale=2, elem_id="ckpt-gguf", elem_classes=[OPERATOR])
        gguf_live = gr.Button("Export GGUF of the live model now", scale=2, elem_id="ckpt-gguf-live",
                              elem_classes=[OPERATOR])
    result = gr.Markdown("", elem_id="ckpt-result")
    section = branches.build(backend, run_state)

    def listing(path: str | None) -> dict:
        return {**_listing(backend, path, about, table, chosen), **branches.show(backend, section, path)}

    refresh = dict(fn=listing, inputs=run_state, outputs=[about, table, chosen, *section.outputs()],
                   api_visibility="private", show_progress="hidden")
    refresh_btn.click(**refresh)
    # resume is offered only with a training checkpoint picked (the final model has no trainer state)
    chosen.change(lambda src: gr.update(interactive=_resumable(src) and may_change(backend)), inputs=chosen, outputs=resume,
                  api_visibility="private", show_progress="hidden")
    resume.click(readable(lambda path, src: _resume(backend, path, src, run_state, tabs)), inputs=[run_state, chosen],
                 outputs=[run_state, tabs], api_visibility="private")
    export.click(readable(lambda src, dst: _export(backend, src, dst, False)), inputs=[chosen, target],
                 outputs=result, api_visibility="private")
    merge.click(readable(lambda src, dst: _export(backend, src, dst, True)), inputs=[chosen, target],
                outputs=result, api_visibility="private")
    gguf.click(readable(lambda src, dst, kind: _export(backend, src, dst, False, kind)),
               inputs=[chosen, target, gguf_type], outputs=result, api_visibility="private")
    gguf_live.click(readable(lambda path, dst, kind: _export_live(backend, path, dst, kind)),
                    inputs=[run_state, target, gguf_type], outputs=result, api_visibility="private")
    return refresh


def _listing(backend: Backend, path: str | None, about: gr.Markdown, table: gr.Dataframe,
             chosen: gr.Dropdown) -> dict:
    try:
        path = backend.session.resolve(path)
        saved = backend.store.saved(path)
    except SessionError as e:
        return {about: str(e), table: pd.DataFrame(columns=list(COLUMNS)), chosen: gr.update(choices=[], value=None)}
    rows = []
    for item, metrics in saved:
        evals = ", ".join(f"{k[5:]} {v:.4g}" for k, v in metrics.items() if k.startswith("eval/"))
        loss = metrics.get("loss")
        rows.append([item.name, item.kind, item.step if item.step is not None else "",
                     f"{loss:.4f}" if loss is not None else "", evals, item.size,
                     "yes" if item.complete else "no (being written or broken)", item.path])
    name = Path(path).name
    checkpoints = sum(1 for r in rows if r[1] == "checkpoint" and r[6] == "yes")
    text = (f"Saved by run **{name}**: {len(rows)} item{'s' * (len(rows) != 1)}." if rows else
            f"Run **{name}** has saved nothing yet (use *Save now* on the Train tab, or "
            "`checkpoint.every_n_steps`).")
    if not checkpoints:
        text += (" *Resume a new run from it* needs a complete training checkpoint"
                 f"{' (the final model holds no trainer state)' if rows else ''}.")
    choices = [(f"{r[0]} ({r[1]}{', step ' + str(r[2]) if r[2] != '' else ''})", r[7]) for r in rows]
    return {about: text, table: pd.DataFrame(rows, columns=list(COLUMNS)),
            chosen: gr.update(choices=choices, value=choices[0][1] if choices else None)}


def _resumable(source: str | None) -> bool:
    return bool(source) and Path(source).parent.name == "checkpoints"


def _resume(backend: Backend, path: str | None, checkpoint: str | None, run_state: gr.State,
            tabs: gr.Tabs) -> dict:
    if not checkpoint or Path(checkpoint).parent.name != "checkpoints":
        raise gr.Error("Pick a training checkpoint (not the final model) to resume from.", print_exception=False)
    info = backend.store.resume_from(path, checkpoint)
    gr.Info(f"Started {info.name}, continuing from {Path(checkpoint).name}.")
    return {run_state: info.path, tabs: gr.Tabs(selected="train")}


def _export_live(backend: Backend, path: str | None, target: str, kind: str) -> str:
    """The running run's model as GGUF: saved at its next step boundary, then converted while it
    trains on (supervisor.client.Verbs.export_gguf)."""
    backend.session.require("gguf")  # writes a model
    if not (target or "").strip():
        raise SessionError("give a folder to export into")
    message = backend.verbs(path).export_gguf((target or "").strip(), kind or "f16")
    return f"**Done:** {message}"


def _export(backend: Backend, source: str | None, target: str, merge: bool, gguf: str | None = None) -> str:
    backend.session.require("gguf" if gguf else "merge" if merge else "export")  # writes a model
    message = backend.store.export(source or "", (target or "").strip(), merge_lora=merge, gguf=gguf)
    return f"**Done:** {message}"
