"""The OpenAI-compatible API on a Gradio app's own port (app.web.openai_mount), in one process with
a small page: /v1 answers with the output folder's keys (and refuses without), the page and
Gradio's own routes still answer. A live run answering through `python -m app`'s port:
tests/test_web.py (test_gradio_client_start_chat_set_stop)."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")


def test_the_api_is_served_under_v1_beside_the_page(tmp_path):
    import gradio as gr

    from app.web.openai_mount import api_mount
    from contract.run_folder import key_of
    route, api = api_mount(tmp_path / "runs")
    with gr.Blocks(analytics_enabled=False) as demo:
        gr.Markdown("page")
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=None, prevent_thread_lock=True, quiet=True,
                            app_kwargs={"routes": [route]})
    try:
        key = key_of(tmp_path / "runs")
        client = openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=key, max_retries=0, timeout=30)
        assert client.models.list().data == []  # no run is answering in this folder
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="lt-wrong", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-run", prompt="x")
        assert httpx.get(f"{url.rstrip('/')}/v1/models").status_code == 401
        page = httpx.get(url)
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert httpx.get(f"{url.rstrip('/')}/config").status_code == 200  # Gradio's own routes as before
    finally:
        demo.close()
        api.state.runs.close()
