"""Checkpoints and exports: models (Hugging Face format), adapters (PEFT format), training state.

Every function takes the trainer first and a local path or fsspec URL, and every rank calls it
(ZeRO-3 gathers are collective); only rank 0 writes what is shared.

- `save_model` / `load_model`         Hugging Face folders (models.py)
- `save_peft` / `load_peft`           PEFT adapter folders; `export_merged`: base + LoRA (adapters.py)
- `save_checkpoint` / `load_checkpoint`  full training state for an exact resume (state.py)
- `checkpoint_callbacks(cfg)`         the save schedule, keep rules, best-model reload (callbacks.py)
- `resolve_resume(value, folder)`     the checkpoint `resume=` names (atomic.py)

Writes are atomic (atomic.py): a folder appears whole, with its completion marker, or not at all.
"""

from __future__ import annotations

from engine.checkpoint.adapters import AdapterError, export_merged, load_peft, save_peft
from engine.checkpoint.atomic import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                                      IncompleteCheckpointError, LayoutMismatchError, MissingFilesError,
                                      WrongKindError, list_checkpoints, resolve_checkpoint)
from engine.checkpoint.callbacks import CheckpointCallback, LoadBestModelCallback, checkpoint_callbacks
from engine.checkpoint.models import ModelLoadError, load_model, save_model
from engine.checkpoint.state import DataMismatchError, load_checkpoint, load_weights, save_checkpoint

__all__ = [
    "save_model", "load_model", "save_peft", "load_peft", "export_merged", "save_checkpoint",
    "load_checkpoint", "load_weights", "checkpoint_callbacks", "resolve_resume", "list_checkpoints",
    "CheckpointCallback", "LoadBestModelCallback", "CheckpointError", "CheckpointNotFoundError",
    "IncompleteCheckpointError", "MissingFilesError", "CorruptCheckpointError", "LayoutMismatchError",
    "WrongKindError", "DataMismatchError", "ModelLoadError", "AdapterError",
]


def resolve_resume(value: str, folder) -> str:
    """The training checkpoint `resume=value` means: "latest" (the newest complete checkpoint of
    the run folder `folder`, a RunFolder), a checkpoint folder, or a folder of checkpoints."""
    return resolve_checkpoint(value, str(folder.checkpoints))
