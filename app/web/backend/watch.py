"""What the pages show of a run, at one moment or over its history: the Train tab's snapshot,
the plots' tables, the log tail, the saved config, and the `/status` answer. Reads the run's
event log (`views.RunView`, one per run, shared by every page) and its manager's info."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from app.embedded import EmbeddedDefault, embedded_default
from app.session import Session, SessionError
from app.web.backend.views import Progress, RunView
from contract.config.schema import PEFT_METHODS
from contract.protocol.states import RunState
from contract.run_folder import RunFolder
from supervisor import Failure, RunInfo
from supervisor.client import CommandError, RunGone


@dataclass(frozen=True)
class Snapshot:
    """Everything the Train tab shows of a run at one moment."""
    path: str
    info: RunInfo
    progress: Progress
    version: int
    failure: Failure | None


class Watch:
    """Run views over `session`'s runs; thread-safe."""

    def __init__(self, session: Session):
        self.session = session
        self._lock = threading.Lock()
        self._views: dict[str, RunView] = {}
        self._embedded: dict[str, EmbeddedDefault | None] = {}

    def view(self, path: str) -> RunView:
        """The run's history, read from its event log as it grows (one view per run)."""
        with self._lock:
            if path not in self._views:
                self._views[path] = RunView(RunFolder(Path(path)))
            return self._views[path]

    def snapshot(self, ref: str | None) -> Snapshot:
        """The run `ref` names now: info, position, what was read of its log, why it failed."""
        path = self.session.resolve(ref)
        info = self.session.info(path)
        view = self.view(path)
        version = view.poll()
        failure = self.session.failure(path) if info.state == RunState.FAILED else None
        return Snapshot(path, info, view.progress(info.state), version, failure)

    def frames(self, path: str, smoothing: float = 0.9) -> dict[str, pd.DataFrame]:
        """The tables the plots draw (see RunView.frames)."""
        return self.view(path).frames(smoothing)

    def log_tail(self, path: str, lines: int = 40) -> str:
        return self.view(path).log_tail(lines)

    def config_text(self, ref: str | None) -> str:
        """The run's config.yaml as it was started."""
        path = self.session.resolve(ref)
        try:
            return RunFolder(Path(path)).config.read_text()
        except OSError as e:
            raise SessionError(f"cannot read the run's config: {e}") from None

    def trains_adapter(self, ref: str | None) -> bool:
        """Whether the run trains a PEFT adapter (so "compare with base model" means something)."""
        try:
            view = self.view(self.session.resolve(ref))
            view.poll()
            return view.method in PEFT_METHODS
        except SessionError:
            return False

    def embedded(self, path: str) -> EmbeddedDefault | None:
        """Whether the run trains the embedded default (app.embedded), read from its config once."""
        with self._lock:
            if path not in self._embedded:
                self._embedded[path] = embedded_default(path)
            return self._embedded[path]

    def status(self, ref: str | None = None) -> dict:
        """The run's info, position and, while it takes commands, its live settings."""
        path = self.session.resolve(ref)
        info = self.session.info(path, fresh=True)
        view = self.view(path)
        view.poll()
        p = view.progress(info.state)
        out = {"run": info.name, "path": path, "state": info.state, "alive": info.alive,
               "step": p.step, "total_steps": p.total, "epoch": p.epoch, "eta_s": p.eta_s,
               "metrics": info.metrics, "error": info.error}
        if info.alive and info.state in (RunState.RUNNING, RunState.PAUSED):
            try:
                live = self.session.client(path, timeout=2.0).status()
                out["settings"], out["queue"] = live.settings, live.queue
            except (SessionError, CommandError, RunGone, OSError, TimeoutError):
                pass
        return out
