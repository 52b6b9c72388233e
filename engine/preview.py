"""What the app's Configure tab shows before a run starts, computed by the engine's own code.

The app process never imports torch, so it asks this module in a child process:

    python -m engine.preview        # one JSON request per stdin line, one JSON answer per line

Requests: ``{"op": "deepspeed", "config": {...}}`` (the DeepSpeed config after "auto" filling),
``{"op": "model", "path": "..."}`` (what a model folder holds), ``{"op": "data", "path": "...",
"format": "auto"}`` (rows and format of a data file), ``{"op": "task", "objective": "dpo"}`` (the files
of the embedded synthetic task's variant that objective trains on, written once). Every answer is ``{"ok": true, ...}`` or
``{"ok": false, "error": "...", "problems": [[field, message], ...]}``; nothing here starts a
process group or touches a run folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from contract import hub
from contract.config.schema import OBJECTIVE_FORMATS, OBJECTIVES, ConfigError, RunConfig
from contract.config.load import load_config
from contract.data_rows import PREFERENCE_FORMATS, preference_columns
from contract import deepspeed_config
from contract import presets

MAX_DATA_ROWS_SHOWN = 2


def deepspeed_preview(data: dict) -> dict:
    """The DeepSpeed config the run would get, with the values the run config fills in."""
    from engine.parallel import ds_config
    cfg = load_config(data=data)
    total, estimated = _total_steps(cfg)
    warmup = cfg.optim.warmup_steps or int(cfg.optim.warmup_ratio * total)
    precision = ds_config.resolve_precision(cfg.train.precision)
    setup = deepspeed_config.build_ds_config(
        cfg, world_size=cfg.world_size, dp_size=cfg.dp_size, total_steps=total, warmup_steps=warmup,
        hidden_size=_hidden_size(cfg), precision=precision)
    return {"config": setup.config, "warnings": setup.warnings, "precision": precision,
            "total_steps": total, "total_steps_estimated": estimated}


def _total_steps(cfg: RunConfig) -> tuple[int, bool]:
    """Optimizer steps of the run; without max_steps, estimated from the number of rows."""
    if cfg.train.max_steps:
        return cfg.train.max_steps, False
    from engine.data import default_task
    if cfg.uses_default_task:
        rows = default_task.N_TRAIN
    else:  # the sources' rows together (data.sources), or data.train's
        rows = sum(len(_rows(s["path"])) for s in cfg.data.sources) if cfg.data.sources else len(_rows(cfg.data.train))
    per_step = cfg.train.micro_batch_size * cfg.dp_size * cfg.train.grad_accum
    return max(1, rows // per_step) * cfg.train.epochs, True


def _hidden_size(cfg: RunConfig) -> int | None:
    if cfg.model.path:
        return _model_config(hub.known_folder(cfg.model.path)).get("hidden_size")
    from engine.data import default_task
    return presets.MODEL_SIZE["hidden"]


def _model_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{folder} has no config.json, so it is not a Hugging Face model folder") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder}/config.json is not valid JSON: {e}") from None
    text = config.get("text_config") or config
    return {**config, "hidden_size": text.get("hidden_size") or text.get("d_model")}


def model_preview(path: str) -> dict:
    """Architecture, size and tokenizer of a local Hugging Face model folder."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"no such folder: {path}")
    config = _model_config(folder)
    from engine.model import loading as model_layer
    info: dict[str, Any] = {
        "architecture": ", ".join(config.get("architectures") or []) or config.get("model_type", "?"),
        "model_type": config.get("model_type"), "hidden_size": config.get("hidden_size"),
        "layers": config.get("num_hidden_layers") or config.get("n_layer"),
        "vocab_size": config.get("vocab_size"), "weights": model_layer.has_weights(folder)}
    info["parameters"] = _parameter_count(folder)
    try:
        tok = model_layer.load_tokenizer(folder)
        info["tokenizer"] = type(tok).__name__
        info["chat_template"] = bool(getattr(tok, "chat_template", None))
    except ValueError as e:
        info["tokenizer"], info["tokenizer_error"] = None, str(e)
    return info


def _parameter_count(folder: Path) -> int:
    """Parameters of the model the folder describes, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _rows(path: str) -> list:
    from contract.data_files import read_rows
    return read_rows(path)[1]


def data_preview(path: str, fmt: str = "auto") -> dict:
    """Rows, their format and the first rows of a data file (or saved dataset folder)."""
    from contract.data_rows import detect_rows_format
    from contract.data_rows import detect_format
    from contract.data_rows import UnreadableRow
    rows = _rows(path)
    unreadable = [n for n, row in rows if isinstance(row, UnreadableRow)]
    detected = detect_rows_format(path, rows) if fmt == "auto" else fmt
    other = sorted({f for _, r in rows if (f := detect_format(r)) and f != detected})
    first = [row for _, row in rows if isinstance(row, dict)][:MAX_DATA_ROWS_SHOWN]
    keys = sorted(first[0]) if first else []
    preview = {"rows": len(rows), "format": detected, "unreadable_rows": unreadable[:10],
               "unreadable": len(unreadable), "other_formats": other, "keys": keys,
               "examples": [_shorten(r) for r in first]}
    if detected in PREFERENCE_FORMATS:  # the answers as columns, to be shown side by side
        preview["pairs"] = [_shorten(c) for r in first if (c := preference_columns(r)) is not None]
    return preview


def _shorten(row: dict, limit: int = 120) -> dict:
    return {k: (v[:limit] + "..." if isinstance(v, str) and len(v) > limit else v) for k, v in row.items()}


def task_files(objective: str) -> dict:
    """The embedded synthetic task's files for `objective` (preference.objective), as a run with
    no data.train reads them: {"train", "eval"} paths and the variant's `format` (input_output for
    sft, preference for dpo / orpo / simpo, unpaired for kto, prompt for grpo)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"preference.objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    from engine.data import default_task
    train, held_out = default_task.sources_for(default_task.ensure_default_assets(), objective)
    return {"train": str(train), "eval": str(held_out), "format": OBJECTIVE_FORMATS.get(objective, "input_output")}


OPS = {"deepspeed": lambda r: deepspeed_preview(r["config"]),
       "model": lambda r: model_preview(r["path"]),
       "data": lambda r: data_preview(r["path"], r.get("format", "auto")),
       "task": lambda r: task_files(str(r.get("objective", "sft")))}


def answer(request: dict) -> dict:
    """One request's answer; every failure becomes a readable message, never a traceback."""
    op = request.get("op")
    if op not in OPS:
        return {"ok": False, "error": f"unknown op {op!r}; allowed: {', '.join(OPS)}"}
    try:
        return {"ok": True, **OPS[op](request)}
    except ConfigError as e:
        return {"ok": False, "error": str(e), "problems": [list(p) for p in e.problems]}
    except ValueError as e:  # our own checks and the data layer's: already a sentence
        return {"ok": False, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - reported to the page as text
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the answer stream
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except json.JSONDecodeError as e:
            result = {"ok": False, "error": f"malformed request: {e}"}
        else:
            result = answer(request) if isinstance(request, dict) else {"ok": False, "error": "a request is a JSON object"}
        out.write(json.dumps(result, default=str) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
