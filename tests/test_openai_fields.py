"""The OpenAI-compatible API checks every field as OpenAI's API reference does: what OpenAI refuses
is answered 400 in its error shape, which the official `openai` client raises as BadRequestError
naming the field (`param`); what OpenAI takes passes on (here to a 404: no run answers in these
tests, and the body is checked before the model is looked up). Real HTTP, real uvicorn, no run."""

from __future__ import annotations

import pytest

from contract.run_folder import key_of
from supervisor.openai_api import ApiServer
from supervisor.openai_models import ChatRequest, CompletionRequest

openai = pytest.importorskip("openai")

CHAT = [{"role": "user", "content": "hi"}]

# (endpoint, fields, the field OpenAI names): each refused with 400
REFUSED = [
    ("chat", {"temperature": 5}, "temperature"),
    ("chat", {"temperature": -0.1}, "temperature"),
    ("completions", {"temperature": 2.5}, "temperature"),
    ("chat", {"top_p": 1.5}, "top_p"),
    ("completions", {"top_p": -0.5}, "top_p"),
    ("chat", {"n": 0}, "n"),
    ("completions", {"n": 1000}, "n"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": -3}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo (scoring the prompt)
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"stop": ""}, "stop"),
    ("chat", {"logit_bias": {"50256": 101}}, "logit_bias"),
    ("completions", {"n": 3, "best_of": 2}, "best_of"),
]

# what OpenAI takes, at the edges of its ranges
TAKEN = [
    ("chat", {"temperature": 2, "top_p": 0, "n": 16, "max_tokens": 1, "presence_penalty": -2,
              "frequency_penalty": 2, "stop": ["a", "b", "c", "d"], "logprobs": True, "top_logprobs": 20}),
    ("chat", {"temperature": 0, "top_p": 1, "logprobs": True, "top_logprobs": 0, "stop": "x",
              "logit_bias": {"50256": -100}, "user": "me"}),
    ("completions", {"temperature": 0, "logprobs": 5, "stop": ["\n"], "best_of": 2, "n": 2}),
    ("completions", {"max_tokens": 0, "echo": True, "logprobs": 0}),
]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    server = ApiServer(root).start()
    try:
        yield openai.OpenAI(base_url=server.url, api_key=key_of(root), max_retries=0, timeout=30)
    finally:
        server.close()


def _ask(api, endpoint: str, fields: dict):
    if endpoint == "chat":
        return api.chat.completions.create(model="no-run", messages=CHAT, **fields)
    return api.completions.create(model="no-run", prompt="hi", **fields)


@pytest.mark.parametrize("endpoint,fields,param", REFUSED, ids=[f"{e}-{p}-{list(f.values())[-1]}" for e, f, p in REFUSED])
def test_what_openai_refuses_is_a_bad_request_naming_the_field(api, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(api, endpoint, fields)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["type"] == "invalid_request_error", error
    assert error["param"] == param and param in error["message"] and "code" in error, error


@pytest.mark.parametrize("endpoint,fields", TAKEN)
def test_what_openai_takes_passes_the_check(api, endpoint, fields):
    with pytest.raises(openai.NotFoundError):  # checked, then no run of that name
        _ask(api, endpoint, fields)


def test_top_p_zero_is_greedy_and_ignored_fields_stay_out_of_the_command():
    chat = ChatRequest.model_validate({"model": "r", "messages": CHAT, "top_p": 0, "temperature": 1.5,
                                       "presence_penalty": 1, "logit_bias": {"1": 5}}).command()
    assert chat.temperature == 0 and chat.top_p is None
    done = CompletionRequest.model_validate({"model": "r", "prompt": "x", "stop": "\n", "logprobs": 5}).command()
    assert done.stop == ["\n"] and done.top_logprobs == 5 and done.logprobs
