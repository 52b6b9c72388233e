"""Chat with what a run left behind, with no live run.

`chat_config(source)` makes the config of a chat-only run (`control.chat_only`, engine.control.chat_only)
for:

- a run folder: its newest complete training checkpoint, else its final model (`model/`);
- a training checkpoint (`trainer_state.json`): the run's own config and layout, with `resume`
  naming the checkpoint, so the very engine state is restored (ZeRO partitions, TP, PP, LoRA);
- a PEFT adapter folder (`adapter_config.json`, a LoRA run's `model/`): the run's config when
  the folder is in a run folder, else the adapter's base model; the adapter is loaded on top;
- a Hugging Face model folder (`config.json`, an export): that model on one rank.

The run manager starts it like any run (`RunManager.start`), in its own folder, named
`chat-<source>`; `RunClient` chats with it as with a training run; `stop` ends it and frees its
memory. Torch-free: it reads only the JSON and YAML the run wrote.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from contract.config.schema import RunConfig
from contract.config.load import config_from_dict, load_config, merge

COMPLETE = "COMPLETE.json"      # a checkpoint's completion marker (engine.checkpoint.atomic)
TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"

# a chat-only run trains, evaluates and saves nothing
_QUIET = {"control": {"enabled": True, "chat_only": True},
          "checkpoint": {"every_n_steps": 0, "every_n_epochs": 0, "save_at_end": False, "keep_best": 0,
                         "load_best_at_end": False},
          "eval": {"every_n_steps": 0, "every_n_epochs": 0, "at_end": False, "early_stopping_patience": 0},
          "logging": {"tensorboard": False, "csv": False, "wandb": "off"},
          "guard": {"enabled": False}}


class ChatSourceError(ValueError):
    """`source` is nothing a chat can be started from; the message says what it is and what would be."""


def chat_config(source: str | Path, name: str | None = None) -> RunConfig:
    """The config of a chat-only run answering from `source` (see the module docstring)."""
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise ChatSourceError(f"chat with {source}: no such file or folder")
    if (path / "config.yaml").is_file() and (path / "events.jsonl").exists():  # a run folder
        return chat_config(_run_model(path), name)
    run = _run_of(path.parent) if path.parent.name == "checkpoints" else _run_of(path)
    label = name or f"chat-{run.name}-{path.name}" if run is not None else name or f"chat-{path.name}"
    if (path / TRAINER_STATE).is_file():
        if not (path / COMPLETE).is_file():
            raise ChatSourceError(f"chat with {path}: this checkpoint is not marked complete (its save did "
                                  "not finish); pick a complete one")
        record = json.loads((path / TRAINER_STATE).read_text())
        return _chat(record.get("config") or {}, {"resume": str(path)}, label)
    if (path / ADAPTER_CONFIG).is_file():
        if run is not None:
            base = _run_config(run)
        else:
            adapter = json.loads((path / ADAPTER_CONFIG).read_text())
            base = {"model": {"path": adapter.get("base_model_name_or_path", "")},
                    "method": {"name": _peft_method(adapter)}, "parallel": {"nproc": 1}}
        base.pop("resume", None)
        return _chat(base, {"control": {"chat_load": str(path)}}, label)
    if (path / "config.json").is_file():
        return _chat({"parallel": {"nproc": 1}}, {"model": {"path": str(path)}}, label)
    raise ChatSourceError(f"chat with {path}: not a run folder, a training checkpoint "
                          f"({TRAINER_STATE}), an adapter ({ADAPTER_CONFIG}) or a model folder (config.json)")


def _run_model(run: Path) -> Path:
    """A run's newest complete training checkpoint, else its final model folder."""
    checkpoints = run / "checkpoints"
    latest = checkpoints / "latest"
    if latest.is_file() and (checkpoints / latest.read_text().strip() / COMPLETE).is_file():
        return checkpoints / latest.read_text().strip()
    complete = sorted((p for p in checkpoints.glob("step-*") if (p / COMPLETE).is_file()),
                      key=lambda p: int(p.name.split("-")[1]) if p.name.split("-")[1].isdigit() else -1)
    if complete:
        return complete[-1]
    if (run / "model").is_dir():
        return run / "model"
    raise ChatSourceError(f"chat with run {run.name}: it has no complete checkpoint and no final model "
                          "(model/) yet; chat with it while it runs, or save one")


def _run_of(folder: Path) -> Path | None:
    run = folder.parent
    return run if (run / "config.yaml").is_file() else None


def _run_config(run: Path) -> dict:
    return load_config(run / "config.yaml").to_dict()


def _peft_method(adapter: dict) -> str:
    return str(adapter.get("peft_type", "LORA")).lower()  # PEFT's type names, as method.name spells them


def _chat(base: dict, extra: dict, name: str) -> RunConfig:
    data = json.loads(json.dumps(base))  # a copy
    for part in (_QUIET, extra, {"logging": {"run_name": f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"}}):
        merge(data, json.loads(json.dumps(part)))
    if "resume" not in extra:
        data["resume"] = ""
    return config_from_dict(data)

