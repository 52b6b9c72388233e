"""A run's saved things, as the Checkpoints tab lists them: training checkpoints (for exact
resume) and the final model or adapter; and the jobs on them (resume a new run from one, export,
merge LoRA), which run the engine's code in a child process so the app never imports torch."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from app.session import Session, SessionError
from app.web.backend.watch import Watch
from contract.config.schema import ConfigError, RunConfig
from contract.config.load import load_config
from contract.run_folder import RunFolder
from supervisor import RunInfo
from supervisor.exports import export

# engine/checkpoint/atomic.py's names (not imported: that package loads torch): a save writes
# into `.tmp-...` and marks a finished folder with COMPLETE.json; only those can be resumed
MARKER = "COMPLETE.json"
TMP_PREFIX = ".tmp-"
_STEP = re.compile(r"step[-_]?(\d+)|(\d+)")  # the number after "step", else the first


@dataclass(frozen=True)
class Saved:
    """One thing a run saved."""
    name: str
    path: str
    kind: str           # checkpoint, model, adapter
    step: int | None
    size_bytes: int
    complete: bool

    @property
    def size(self) -> str:
        return human_size(self.size_bytes)


def list_saved(folder: RunFolder) -> list[Saved]:
    """Training checkpoints (newest first), then the final model or adapter if there is one."""
    found = []
    if folder.checkpoints.is_dir():
        for path in folder.checkpoints.iterdir():
            if not path.is_dir() or path.is_symlink():
                continue
            match = _STEP.search(path.name)
            step = int(match.group(1) or match.group(2)) if match else None
            complete = not path.name.startswith(TMP_PREFIX) and (path / MARKER).exists()
            found.append(Saved(path.name, str(path), "checkpoint", step,
                               folder_size(path), complete))
    found.sort(key=lambda s: (not s.complete, s.step is None, -(s.step or 0)))  # newest complete first
    model = folder.model
    if model.is_dir() and any(model.iterdir()):
        kind = "adapter" if (model / "adapter_config.json").exists() else "model"
        found.append(Saved("model", str(model), kind, None, folder_size(model), True))
    return found


def chat_only(run: Path) -> bool:
    """Whether the run is a chat-only copy (control.chat_only in its config)."""
    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(cfg, dict) and bool((cfg.get("control") or {}).get("chat_only"))


def folder_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def resume_config(folder: RunFolder, checkpoint: str) -> RunConfig:
    """The run's own config, continuing from `checkpoint` in a new run folder."""
    return load_config(folder.config, [f"resume={checkpoint}", f"run_name={folder.root.name}-resumed"])


class Store:
    """The Checkpoints tab's jobs on the runs of `session` (metrics from `watch`'s views)."""

    def __init__(self, session: Session, watch: Watch):
        self.session, self.watch = session, watch

    def saved(self, ref: str | None) -> list[tuple[Saved, dict[str, float]]]:
        """What the run saved, each with the metrics logged at its step."""
        path = self.session.resolve(ref)
        view = self.watch.view(path)
        view.poll()
        return [(s, view.metrics_at(s.step) if s.step is not None else {})
                for s in list_saved(RunFolder(Path(path)))]

    def answering_runs(self, ref: str | None) -> list[RunInfo]:
        """The runs other than `ref` that can answer a chat beside it: the live ones first, then
        those that ended having saved a checkpoint or a model (chat-only runs left out)."""
        root = self.session.resolve(ref)
        others = [i for i in self.session.runs() if i.path != root and not chat_only(Path(i.path))]
        return ([i for i in others if i.alive] +
                [i for i in others if not i.alive and any(s.complete for s in list_saved(RunFolder(Path(i.path))))])

    def resume_from(self, ref: str | None, checkpoint: str):
        """A new run continuing exactly from `checkpoint` of run `ref`; returns its RunInfo."""
        path = self.session.resolve(ref)
        if not checkpoint or not Path(checkpoint).is_dir():
            raise SessionError("pick a training checkpoint of this run first")
        try:
            cfg = resume_config(RunFolder(Path(path)), checkpoint)
        except ConfigError as e:
            raise SessionError(str(e)) from None
        return self.session.start(cfg)

    def export(self, source: str, target: str, merge_lora: bool = False, gguf: str | None = None) -> str:
        """Export a checkpoint, model or adapter into the new folder `target` (see `export`)."""
        self.session.require("export")  # it writes a folder as the app's user: an operator's
        if not source or not Path(source).exists():
            raise SessionError("pick a checkpoint, model or adapter first")
        if not target:
            raise SessionError("give a folder to export into")
        try:
            return export(source, target, merge_lora, gguf=gguf)
        except RuntimeError as e:
            raise SessionError(str(e)) from None
