"""Checkpoints and exports: models (Hugging Face format), adapters (PEFT format), training state.

Every function takes the run first (its `engine.context.RunContext`, or the Trainer, which has
the same attributes) and a local path or fsspec URL, and every rank calls it (ZeRO-3 gathers are
collective); only rank 0 writes what is shared.

- `save_model` / `load_model`         Hugging Face folders: the run's method and layout decide
                                      how (models.py primitives; adapters for PEFT; engine.parallel
                                      for tensor / pipeline parallelism)
- `save_peft` / `load_peft`           PEFT adapter folders; `export_merged`: base + LoRA (adapters.py)
- `save_checkpoint` / `load_checkpoint`  full training state for an exact resume (state.py; these
                                      take the Trainer, whose methods add the callbacks' states)
- `CheckpointSchedule`, `load_best`   the save schedule, keep rules, best-model reload (schedule.py)
- `resolve_resume(value, folder)`     the checkpoint `resume=` names (below)

Writes are atomic (atomic.py: the ranks agree through agreement.py, folders are published by publish.py): a folder appears whole, with its completion marker, or not at all.
"""

from __future__ import annotations

from engine.context import RunContext
from engine.checkpoint.adapters import AdapterError, export_merged
from engine.checkpoint.locations import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                                         IncompleteCheckpointError, LayoutMismatchError, MissingFilesError,
                                         WrongKindError)
from engine.checkpoint.reading import list_checkpoints, resolve_checkpoint
from engine.checkpoint.models import DEFAULT_SHARD_SIZE, ModelLoadError
from engine.checkpoint.schedule import CheckpointSchedule, load_best
from engine.checkpoint.compatible import DataMismatchError
from engine.checkpoint.state import load_weights

__all__ = [
    "save_model", "load_model", "save_peft", "load_peft", "export_merged", "save_checkpoint",
    "load_checkpoint", "load_weights",
    "resolve_resume", "list_checkpoints", "CheckpointSchedule", "load_best", "CheckpointError",
    "CheckpointNotFoundError", "IncompleteCheckpointError", "MissingFilesError", "CorruptCheckpointError",
    "LayoutMismatchError", "WrongKindError", "DataMismatchError", "ModelLoadError", "AdapterError",
]


def save_model(run: RunContext, path: str, max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> dict:
    """The engine's model in Hugging Face format at `path` (local or fsspec URL); collective.

    With a PEFT model this writes the adapter in PEFT's layout (as the run folder's `model/`
    promises); `export_merged` writes base + LoRA as one plain model.
    """
    return run.method.save_model(run, path, max_shard_size)


def load_model(run: RunContext, path: str) -> None:
    """Weights of a Hugging Face folder (local or fsspec URL) into the running engine; collective.
    With a PEFT model: an adapter folder loads as the trained adapter, a plain model folder into
    the base model's weights."""
    run.method.load_model(run, path)


def save_peft(run: RunContext, path: str, selected_adapters: list[str] | None = None) -> dict:
    """Selected adapters (all when None) in PEFT's layout; without PEFT, the model (as CoLLie)."""
    return run.method.save_peft(run, path, selected_adapters)


def load_peft(run: RunContext, path: str, adapter_name: str = "default", is_trainable: bool = True) -> None:
    """The adapter saved at `path` into the engine's adapter `adapter_name`; without PEFT, the model."""
    run.method.load_peft(run, path, adapter_name, is_trainable)


def save_checkpoint(trainer, path: str) -> str:
    """Everything an exact resume needs at `path`; collective. `trainer`: the Trainer, whose
    callbacks' and loop parts' states go in too (this calls `trainer.save_checkpoint`; the
    writing is state.py's). Returns the checkpoint's URL."""
    return trainer.save_checkpoint(path)


def load_checkpoint(trainer, path: str) -> None:
    """Restore the training state saved at `path` into the Trainer; collective."""
    trainer.load_checkpoint(path)


def resolve_resume(value: str, folder) -> str:
    """The training checkpoint `resume=value` means: "latest" (the newest complete checkpoint of
    the run folder `folder`, a RunFolder), a checkpoint folder, or a folder of checkpoints."""
    return resolve_checkpoint(value, str(folder.checkpoints))
