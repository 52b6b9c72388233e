"""Jupyter front end: widgets over a live run, and plain calls for people who prefer code.

    from app.notebook import RunPanel, start, attach, runs
    RunPanel()                        # form, controls, live plots, chat, run picker
    run = start(None, "max_steps=50") # or drive a run from code
    preview_data("pairs.jsonl")       # a data file's rows (preference pairs side by side)

Torch-free, like all of app/: training runs in its own process group, never in the kernel. The
form (`app.form`) and the session (`app.session`) are the web app's own, so both behave alike.
"""

from app.notebook.api import Run, RunFailed, attach, default_output_dir, manager, runs, session, start
from app.form import make_config
from app.notebook.chat import ChatBox
from app.notebook.form import ConfigForm
from app.notebook.panel import RunPanel
from app.notebook.preview import DataPreview, preview_data

__all__ = ["Run", "RunFailed", "RunPanel", "ConfigForm", "ChatBox", "start", "attach", "runs",
           "manager", "session", "make_config", "default_output_dir", "preview_data", "DataPreview"]
