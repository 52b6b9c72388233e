"""A script the page must run before Gradio's own code, put at the top of the page's <head> by
a small ASGI middleware (Gradio's `head=` is added by its front end once it has loaded, too late
for this).

Why: Gradio 6's status tracker runs a requestAnimationFrame loop for as long as a status it
shows is pending, and the loop of the loader shown while the page starts is never ended: every
open page asks the browser for 60 frames a second for as long as it stays open (measured: ~11%
of a core for an idle page on this machine, the same on every tab). The app shows no progress
timers (its events use show_progress="hidden"), so the script gives the status tracker's frame
requests one frame a second instead; every other caller (the plots, Gradio's transitions) gets
its frames as before. If a Gradio version renames the tracker's file the script does nothing.
"""

from __future__ import annotations

from typing import Any

SCRIPT = b"""<script>(() => {
  const frame = window.requestAnimationFrame.bind(window);
  window.requestAnimationFrame = callback => ((new Error().stack || '').includes('statustracker')
    ? setTimeout(() => frame(callback), 1000) : frame(callback));
})();</script>"""


class EarlyScript:
    """ASGI middleware: SCRIPT goes right after `<head>` in the HTML of the app's page (GET /).
    Every other response passes through untouched."""

    def __init__(self, app: Any, script: bytes = SCRIPT):
        self.app = app
        self.script = script

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "GET" or scope.get("path") not in ("/", ""):
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body: list[bytes] = []

        async def rewrite(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message  # held until the body is whole: its length changes
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            page = b"".join(body)
            headers = [(k, v) for k, v in start.get("headers", [])]
            kind = next((v for k, v in headers if k.lower() == b"content-type"), b"")
            packed = any(k.lower() == b"content-encoding" for k, _ in headers)
            if kind.startswith(b"text/html") and not packed and b"<head>" in page:
                page = page.replace(b"<head>", b"<head>" + self.script, 1)
                headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(page)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": page})

        await self.app(scope, receive, rewrite)
