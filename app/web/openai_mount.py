"""The OpenAI-compatible API (supervisor.openai_api) on the web app's own port, under /v1: one
process and one address for the page and for the `openai` client, Open WebUI or
lm-evaluation-harness, over the runs of the app's output folder, with the same keys as
`./launch.sh serve` (the output folder's `api_key.json` opens every run, each run's its own).

How: the API's FastAPI app is a route of Gradio's (`launch(app_kwargs={"routes": [...]})`: routes
given when the app is made come before Gradio's own, so /v1 is never taken by a page route).
Gradio's login does not guard it; the API's bearer keys do, as they do in `./launch.sh serve`.
`python -m app --no-api` leaves it out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.routing import Mount

from contract.run_folder import KEY_FILE, VIEWER_KEY_FILE, key_of
from supervisor.openai_api import create_app

PREFIX = "/v1"


class _Unprefixed:
    """ASGI: hands the API the path as it came. A Mount strips its prefix (it moves it into
    `root_path`), but the API declares its routes with /v1 in them, as its own server serves them."""

    def __init__(self, app: FastAPI, prefix: str):
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            root = scope.get("root_path", "")
            scope = {**scope, "root_path": root[:-len(self.prefix)] if root.endswith(self.prefix) else root}
        await self.app(scope, receive, send)


def api_mount(output_dir: str | Path) -> tuple[Mount, FastAPI]:
    """The route that serves the API under /v1 for the runs in `output_dir`, and the API app
    (close its runs' connections at the end: `app.state.runs.close()`). Makes the output folder's
    keys if they are missing."""
    root = Path(output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    key_of(root)
    key_of(root, VIEWER_KEY_FILE)
    api = create_app(root)
    return Mount(PREFIX, app=_Unprefixed(api, PREFIX)), api


def api_note(url: str, output_dir: str | Path) -> str:
    """What the app prints about the API at start."""
    root = Path(output_dir).resolve()
    return (f"livetune: OpenAI-compatible API on {url.rstrip('/')}{PREFIX} (key for every run: {root / KEY_FILE}; "
            f"a viewer's: {root / VIEWER_KEY_FILE}; --no-api to leave it out)")
