"""The Gradio web app: one module per tab (configure, train, chat, checkpoints, runs), each only
laying out components and wiring their events to the `Backend`'s jobs (session, form, watch,
store, preview); every handler returns its outputs keyed by component. `api` adds the named
endpoints.

    backend = Backend("runs")
    demo = build_app(backend)
    demo.launch(server_name="127.0.0.1", server_port=7860, **launch_options())

Each browser page keeps the run it shows in a `gr.State`; a page that opens (or reloads) while a
run is going opens on that run's Train tab, its plots rebuilt from the event log.
"""

from __future__ import annotations

import gradio as gr
from starlette.middleware import Middleware

from app.web import access, api, chat, checkpoints, configure, feed, runs, train
from app.web.backend import Backend
from app.web.early_script import EarlyScript
from app.web.widgets import CSS

TITLE = "livetune"


def build_app(backend: Backend) -> gr.Blocks:
    """The whole page, wired to `backend`."""
    with gr.Blocks(title=TITLE, analytics_enabled=False, fill_width=True) as demo:
        with gr.Row(equal_height=True):
            gr.Markdown(f"## {TITLE} · fine-tune a language model and talk to it while it trains",
                        elem_id="app-title")
            signed_in = gr.HTML("", elem_id="signed-in", scale=0, min_width=160)  # with logins: who, log out
        run_state = gr.State(None)  # the run folder this page shows
        marker = feed.build(backend)  # the live feed, beside the tabs: it serves whichever shows
        with gr.Tabs(selected="configure", elem_id="tabs") as tabs:
            with gr.Tab("Configure", id="configure", elem_id="tab-configure"):
                config_tab = configure.build(backend, run_state, tabs)
            with gr.Tab("Train", id="train", elem_id="tab-train"):
                train.build(backend, run_state, tabs, config_tab, demo, marker)
            with gr.Tab("Chat", id="chat", elem_id="tab-chat") as chat_tab:
                chat_refresh = chat.build(backend, run_state)
            with gr.Tab("Checkpoints", id="checkpoints", elem_id="tab-checkpoints") as ckpt_tab:
                ckpt_refresh = checkpoints.build(backend, run_state, tabs)
            with gr.Tab("Runs", id="runs", elem_id="tab-runs") as runs_tab:
                runs_refresh = runs.build(backend, run_state, tabs)
        config_tab.validation()
        chat_tab.select(**chat_refresh)
        ckpt_tab.select(**ckpt_refresh)
        runs_tab.select(**runs_refresh)
        api.register(backend)
        access.wire(demo, backend, signed_in)  # a viewer's page: operator-only controls off, with a why
    return demo


def launch_options() -> dict:
    """The look of the page (Gradio 6 takes theme and CSS at launch), and the script that must
    run before Gradio's own (early_script: an idle page would otherwise ask for 60 frames a
    second)."""
    theme = gr.themes.Soft(primary_hue="indigo", secondary_hue="slate")
    return {"theme": theme, "css": CSS, "footer_links": ["api"], "head": train.NAVIGATION_HEAD + access.TOOLTIP_HEAD,
            "app_kwargs": {"middleware": [Middleware(EarlyScript)]}}
