"""Jupyter front end: widgets over a live run, and plain calls for people who prefer code.

    from app.notebook import RunPanel, start, attach, runs
    RunPanel()                        # form, controls, live plots, chat, run picker
    run = start(None, "max_steps=50") # or drive a run from code

Torch-free, like all of app/: training runs in its own process group, never in the kernel.
"""

from app.notebook.api import (Run, RunFailed, absolute_paths, attach, default_output_dir,
                              make_config, manager, runs, start)
from app.notebook.chat import ChatBox
from app.notebook.form import ConfigForm
from app.notebook.panel import RunPanel

__all__ = ["Run", "RunFailed", "RunPanel", "ConfigForm", "ChatBox", "start", "attach", "runs",
           "manager", "make_config", "absolute_paths", "default_output_dir"]
