"""The web app's backend: everything the pages do, and nothing of how they look. One object per
job, each in its own module, put together here (the tab modules in `app.web` only lay out
components and call these):

    session   app.session.Session: which run, start, attach, commands, chat, stop (shared with
              the notebook, so both front ends behave alike)
    form      app.form.Form: the config fields, form values <-> RunConfig (shared with the notebook)
    watch     watch.Watch: snapshots, plot tables, log tail, config text, status
    store     store.Store: what a run saved; resume a new run from a checkpoint; export
    preview   preview.PreviewWorker: DeepSpeed JSON and model / data previews from a child process

    backend = Backend("runs")
    info = backend.session.start(backend.form.check(values).config)
    backend.verbs(info.path).pause()

Every failure is raised as `app.session.SessionError`, with a sentence a user can act on.
"""

from __future__ import annotations

from pathlib import Path

from app.form import Form
from app.session import Session
from app.session_verbs import SessionVerbs
from app.web.backend.preview import PreviewWorker
from app.web.backend.store import Store
from app.web.backend.watch import Watch


class Backend:
    """The jobs the pages call, over the runs under `output_dir` (and any folder a config names)."""

    def __init__(self, output_dir: str | Path, run_env: dict[str, str] | None = None,
                 hang_timeout: float = 300.0):
        self.session = Session(output_dir, run_env=run_env, hang_timeout=hang_timeout)
        self.form = Form(str(self.session.output_dir))
        self.watch = Watch(self.session)
        self.store = Store(self.session, self.watch)
        self.preview = PreviewWorker()

    def verbs(self, path: str | Path | None) -> SessionVerbs:
        """The verbs of the run `path` names (the same ones the notebook, the CLI and the Python
        client call), sent through this app's session and its role checks."""
        return SessionVerbs(self.session, path)

    @property
    def output_dir(self) -> Path:
        return self.session.output_dir

    def close(self) -> None:
        """Stop watching and close connections (the runs themselves go on)."""
        self.session.close()
        self.preview.close()
