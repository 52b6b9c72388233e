"""What a notebook shows in place of a widget when its front end cannot draw widgets (JupyterLab
without `jupyterlab_widgets`, a viewer such as GitHub's): a note that says how to get them,
instead of the widget's bare repr (`VBox(children=(Accordion(...`). A front end that can draw
the widget picks the widget's own view from the same bundle and never shows the note."""

from __future__ import annotations

from typing import Any

NOTE = ("The livetune {what} is an interactive widget (ipywidgets), and this notebook front end "
        "cannot draw widgets. Open the notebooks with `./launch.sh notebook` (JupyterLab with the "
        "widgets extension and the `livetune` kernel), or install `jupyterlab_widgets` into the "
        "environment that runs JupyterLab (`widgetsnbextension` for the classic Notebook) and reload "
        "the page. The same controls are in the web app: `./launch.sh`.")


def with_note(bundle: Any, what: str) -> Any:
    """A widget's mime bundle with the note as its text/plain and text/html fallbacks."""
    data, metadata = bundle if isinstance(bundle, tuple) else (bundle, None)
    if not isinstance(data, dict):
        return bundle
    note = NOTE.format(what=what)
    code = note.replace("`", "")
    html = ("<div style='border-left:4px solid #d97706;padding:6px 10px;background:#fffbeb'>"
            f"<b>Widgets cannot be shown here.</b> {code}</div>")
    data = {**data, "text/plain": note, "text/html": html}
    return (data, metadata) if metadata is not None else data
