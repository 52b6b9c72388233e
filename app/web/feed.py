"""The page's live feed (watching must not slow training, and what a visible tab shows stays
current): what changes every step goes to the page by one small call a second
from the page itself (feed.js, through Gradio's `server_functions`, which checks the login like
any other call), not by a Gradio event. On the Train tab that is the status line, the side chat's
"running, step N" header and the plots' new points; on the Chat tab, its header ("Talking to run
X -- running, step N"). An event costs the page far more than its data: Gradio's front end marks
each output pending and then complete, walks and copies its component tree for both, and runs an
animation loop per output while pending; at 14 steps/s that bookkeeping alone took a sixth of a
core from a 2-core machine's training.

The feed lives in a hidden element of the page itself (`build`), beside the tabs, so it runs
whichever tab the page opened on. Gradio events remain for what changes rarely: the buttons, the
failure banner, the log tail, the run the page shows (train.refresh, "the look"). The look writes
the run and its state into a hidden marker (`marker_html`); while the Train tab shows, the feed
asks the page for a look whenever the state it reads differs from the marker's (a pause, the end
of the run), and while the log tail is open.

Only what the page lacks is sent, and only for what is on screen (`want`): the status line and
the header when they differ from what it holds (it sends back their digests), and for each plot
the points after its last one (plots.batch). The page asks only while the Train or the Chat tab
is on screen and the browser tab is shown.
"""

from __future__ import annotations

import hashlib
import html
from pathlib import Path
from typing import Any, Callable

import gradio as gr
from markdown_it import MarkdownIt

from app.session import SessionError
from app.web import chat
from app.web.backend import Backend
from app.web.plots import MAIN_PLOTS, MORE_PLOTS, PREFERENCE_PLOTS, batch, plot_id
from app.web.widgets import status_html

EVERY_MS = 1000  # how often the page asks while the Train or Chat tab shows
JS = (Path(__file__).with_name("feed.js")).read_text().replace("EVERY_MS_VALUE", str(EVERY_MS))
MARKER_ID = "train-looked"  # the look's marker: the run the page shows and its state then
LOOK_ID = "train-look"      # the hidden button the feed presses to ask for a look
PLOT_IDS = {name: plot_id("train", name) for name in (*MAIN_PLOTS, *PREFERENCE_PLOTS, *MORE_PLOTS)}  # make_plots("train")
HOST_ID = "live-feed"       # the hidden element whose js_on_load runs the feed
PARTS = ("status", "header", "plots")  # what a page may want: the Train tab all, the Chat tab the header
_MARKDOWN = MarkdownIt("commonmark", {"html": False})


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def marker_html(path: str | None, state: str | None) -> str:
    """The hidden marker the look leaves: the feed reads the run from it and compares states."""
    return (f"<span data-run='{html.escape(path or '', quote=True)}' "
            f"data-state='{html.escape(state or '', quote=True)}'></span>")


def build(backend: Backend) -> gr.HTML:
    """The feed's hidden host and the look's marker, placed by the caller outside the tabs (a tab's
    children are only drawn once it is first shown); returns the marker (train.TrainView's)."""
    gr.HTML("", elem_id=HOST_ID, visible="hidden", js_on_load=JS, server_functions=[feed_function(backend)])
    return gr.HTML(marker_html(None, None), elem_id=MARKER_ID, visible="hidden")


def feed(backend: Backend, ask: Any) -> dict:
    """One answer to the page: `ask` is {"run": path, "want": the parts on screen (PARTS; all
    when not given), "have": what its plots hold (by element id, as plots.batch reads it),
    "known": {"status", "header": digests of what it shows, "version": of the run's view when
    it last asked}}."""
    ask = ask if isinstance(ask, dict) else {}
    path = ask.get("run")
    if not isinstance(path, str) or not path:
        return {"run": path, "error": "no run"}
    known = ask.get("known") if isinstance(ask.get("known"), dict) else {}
    have = ask.get("have") if isinstance(ask.get("have"), dict) else {}
    want = set(ask["want"]) & set(PARTS) if isinstance(ask.get("want"), list) else set(PARTS)
    try:
        snap = backend.watch.snapshot(path)
    except SessionError as e:
        return {"run": path, "error": str(e)}
    out: dict[str, Any] = {"run": path, "state": snap.info.state, "version": snap.version}
    if "status" in want:
        status = status_html(snap)
        if (status_id := digest(status)) != known.get("status"):
            out["status"], out["status_id"] = status, status_id
    if "header" in want:
        header = chat.header(backend, snap)
        if (header_id := digest(header)) != known.get("header"):
            out["header"], out["header_id"] = _MARKDOWN.renderInline(header), header_id
    plots: dict[str, str] = {}
    stale = any(not isinstance(have.get(i), dict) or have[i].get("path") != snap.path for i in PLOT_IDS.values())
    if "plots" in want and (snap.version != known.get("version") or stale):
        series = backend.watch.view(snap.path).series()
        for name, elem_id in PLOT_IDS.items():
            found = batch(series.get(name, {}), have.get(elem_id), snap.path, snap.version)
            if found is not None:
                plots[elem_id] = found
    out["plots"] = plots
    return out


def feed_function(backend: Backend) -> Callable[[Any], dict]:
    """`feed` bound to `backend`, named as feed.js calls it (`server.feed`)."""
    def feed_call(ask: Any) -> dict:
        return feed(backend, ask)
    feed_call.__name__ = "feed"
    return feed_call
