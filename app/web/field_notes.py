"""The notes under the Configure tab's model and data fields: what a model folder holds, a page of
a data file's rows judged by the form (app.data_preview.rows_page), the embedded task's rows of
the objective's variant when there is no file, and the evaluation schedule switched off for the
user's own data without evaluation data. Plain functions of the form's values: the tab
(app.web.configure) wires them to its fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.data_preview import RowsPage, page_or_error, rows_markdown
from app.web.backend import Backend
from app.web.backend.preview import PreviewError, describe_data, describe_model

INSPECTED = {"model.path": "model", "data.train": "data", "data.eval": "data"}  # fields with a note


# what the embedded task gives each objective (engine/data/default_task.py sources_for)
TASK_VARIANTS = {
    "sft": "its instruction rows (input → output)",
    "dpo": "its pairs variant: each prompt with the right answer chosen over a wrong one "
           "(prompt `reverse: abc`, chosen `cba`, rejected what a half-trained model says, here the word "
           "echoed: `abc`)",
    "kto": "its unpaired variant: each prompt's right answer marked desirable, a wrong one undesirable",
    "grpo": "its prompts variant: each prompt with its right answer, which exact match rewards",
}
EVAL_KEYS = ("eval.every_n_steps", "eval.every_n_epochs")


def idle_note(key: str, objective: str = "sft") -> str:
    """The note under an empty field: what the run takes instead (the embedded model, the
    embedded task's variant for `objective`, its held-out split)."""
    if key == "model.path":
        return "Empty: the embedded tiny Llama (2 layers, hidden 128, character tokenizer)."
    if key == "data.train":
        variant = TASK_VARIANTS.get(objective, TASK_VARIANTS["dpo"])  # orpo, simpo: pairs as dpo
        return f"Empty: the embedded synthetic task (reverse / sort / upper a word), {variant}."
    return "Empty: the default task's held-out split, or no evaluation data."


def evaluation_off(values: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """When the user's own training data comes without evaluation data while the form schedules
    evaluations (a preset made for the embedded task, which has a held-out split): the schedule
    switched off, and the note that says so; ({}, "") otherwise. Start then stays possible."""
    scheduled = [k for k in EVAL_KEYS if values.get(k)]
    if not (str(values.get("data.train") or "").strip() and scheduled) or str(values.get("data.eval") or "").strip():
        return {}, ""
    was = ", ".join(f"{k} {values[k]}" for k in scheduled)
    return {k: 0 for k in scheduled}, (
        f"**Evaluation switched off** ({was} → 0): your training data comes without evaluation data. "
        "Name a held-out file in data.eval and set the schedule again to evaluate.")


LIMIT_KEYS = ("data.max_length", "data.overlong", "model.path")  # what a data file's page of rows is judged by


def field_note(backend: Backend, key: str, path: str, fmt: str, objective: str | None = None,
               max_length: Any = 0, overlong: str = "truncate", model: str = "") -> str:
    """The note under a model or data field: what the folder or file holds; for data, a page of
    its rows judged by the form's data.max_length, data.overlong, model (its tokenizer) and, for
    training data, preference.objective; data.train empty: the embedded task's rows of the variant
    the objective trains on."""
    path = (path or "").strip()
    objective = objective or "sft"
    limits = {"max_length": int_or_zero(max_length), "overlong": overlong or "truncate",
              "tokenizer_folder": (model or "").strip() or None}
    if not path:
        return _task_rows(backend, objective, limits) if key == "data.train" else idle_note(key, objective)
    if not Path(path).exists():
        return f"**Cannot use it:** no such {'folder' if key == 'model.path' else 'file or folder'}: `{path}`"
    try:
        if INSPECTED[key] == "model":
            return describe_model(backend.preview.model(path))
        page = page_or_error(path, fmt=fmt or "auto", objective=objective if key == "data.train" else None,
                             **limits)  # a page of rows, judged
        return describe_data(backend.preview.data(path, fmt or "auto"), page)
    except PreviewError as e:
        return f"**Cannot look at it now:** {e}"


def _task_rows(backend: Backend, objective: str, limits: dict[str, Any]) -> str:
    """The data.train note without a file: which variant of the embedded task the objective trains
    on, and a page of its rows (the engine writes the variant's file: preview op `task`)."""
    note = idle_note("data.train", objective)
    try:
        files = backend.preview.task(objective)
    except PreviewError as e:
        return f"{note}\n\n**Cannot show its rows now:** {e}"
    if not files.get("ok"):
        return f"{note}\n\n**Cannot show its rows:** {files.get('error')}"
    page = page_or_error(files["train"], fmt=files["format"], objective=objective, **limits)
    return f"{note}\n\n" + (rows_markdown(page) if isinstance(page, RowsPage) else page)


def int_or_zero(value: Any) -> int:
    """A number box's value as an int (0 when empty or not a number: no limit)."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
