"""The OpenAI-compatible API's torch-free pieces, without a run: the stop filter of a stream, model
names of runs and chat sessions, keys (mode 0600), request bodies turned into `complete`
commands, and the errors a request gets before any run is asked (real HTTP, real uvicorn)."""

from __future__ import annotations

import os
import stat

import httpx
import pytest
from pydantic import ValidationError

from contract.protocol.completion_commands import Complete
from contract.protocol.base import ProtocolError
from contract.protocol.commands import command_from_wire
from contract.run_folder import KEY_FILE, key_of
from supervisor.openai_api import ApiServer, model_name
from supervisor.openai_models import ChatRequest, CompletionRequest
from supervisor.openai_stream import StopFilter


def test_the_stop_filter_holds_back_what_may_begin_a_stop_string_and_cuts_at_it():
    f = StopFilter(["END", "\n\n"])
    sent = [f.feed(p) for p in ["hel", "lo E", "N", "D and more", "more"]]
    assert "".join(sent) == "hello " and sent[:3] == ["hel", "lo ", ""]  # "E", "EN" waited: they begin "END"
    g = StopFilter(None)
    assert [g.feed(p) for p in ["a", "b"]] == ["a", "b"]
    h = StopFilter(["xyz"])
    assert h.feed("abx") == "ab" and h.feed("q") == "xq"  # "x" was held: not the start of a stop after all


def test_model_names_of_runs_and_chat_sessions(tmp_path):
    run = tmp_path / "my-run"
    (run / "checkpoints" / "step-40").mkdir(parents=True)
    (run / "config.yaml").write_text("control:\n  enabled: true\n")
    assert model_name(run) == "my-run"
    chat = tmp_path / "chat-my-run-step-40-20261204"
    chat.mkdir()
    (chat / "config.yaml").write_text(f"resume: {run / 'checkpoints' / 'step-40'}\ncontrol:\n  chat_only: true\n")
    assert model_name(chat) == "my-run@step-40"
    export = tmp_path / "chat-model"
    export.mkdir()
    (export / "config.yaml").write_text(f"model:\n  path: {run / 'model'}\ncontrol:\n  chat_only: true\n")
    assert model_name(export) == "my-run@model"


def test_a_key_is_made_once_and_only_its_owner_can_read_it(tmp_path):
    key = key_of(tmp_path)
    assert key.startswith("lt-") and key_of(tmp_path) == key
    assert stat.S_IMODE(os.stat(tmp_path / KEY_FILE).st_mode) == 0o600


def test_request_bodies_become_complete_commands_and_bad_ones_name_their_field():
    scoring = CompletionRequest.model_validate({"model": "r", "prompt": [[1, 2, 3]], "max_tokens": 0, "echo": True,
                                                "logprobs": 1}).command()
    assert scoring == Complete(prompts=[[1, 2, 3]], max_new_tokens=0, echo=True, logprobs=True, top_logprobs=1)
    chat = ChatRequest.model_validate({"model": "r", "stop": "x", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"}]}).command()
    assert chat.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat.stop == ["x"] and chat.max_new_tokens is None  # the run's chat default applies
    with pytest.raises(ValidationError, match="max_tokens 0 needs `echo"):  # refused with the body
        CompletionRequest.model_validate({"model": "r", "prompt": "x", "max_tokens": 0})
    with pytest.raises(ProtocolError, match=r"prompts\[1\]"):
        command_from_wire("complete", {"prompts": ["a", [1, -2]]})


def test_requests_refused_before_any_run_is_asked(tmp_path):
    server = ApiServer(tmp_path).start()
    try:
        auth = {"Authorization": f"Bearer {key_of(tmp_path)}"}  # the output folder's key: every run
        assert httpx.get(f"{server.url}/models", headers=auth).json() == {"object": "list", "data": []}
        wrong = httpx.get(f"{server.url}/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        missing = httpx.post(f"{server.url}/chat/completions", headers=auth,
                             json={"model": "gone", "messages": [{"role": "user", "content": "x"}]})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        bad = httpx.post(f"{server.url}/chat/completions", headers=auth, json={"model": "gone", "messages": []})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        broken = httpx.post(f"{server.url}/completions", headers=auth, content=b"{not json")
        assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    finally:
        server.close()
