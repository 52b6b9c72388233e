"""The request bodies of the OpenAI-compatible API (supervisor.openai_api), as pydantic v2 models,
and how each becomes the run's `complete` command (contract.protocol.completion_commands.Complete).

Every field is checked against the range OpenAI's API reference gives it (temperature 0 to 2, top_p
0 to 1, penalties -2 to 2, completions `logprobs` 0 to 5, chat `top_logprobs` 0 to 20 and only
with `logprobs: true`, at most 4 stop strings, ...) by pydantic constraints, so a request OpenAI
would refuse with 400 is refused here with 400 too, naming the field. Fields the API does not act
on (`user`, `presence_penalty`, `logit_bias`, ...) are checked the same way and then ignored, as
most OpenAI-compatible servers do, so clients that always send them work. Torch-free.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from contract.protocol.completion_commands import (MAX_COMPLETION_TOKENS, MAX_PROMPTS, MAX_SAMPLES,
                                                   MAX_TOP_LOGPROBS, Complete)

MAX_STOP = 4                # stop strings per request (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions `logprobs` (OpenAI's limit)

StopString = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence / frequency penalty (accepted, not acted on)


def refused(param: str, message: str) -> PydanticCustomError:
    """A refusal of a rule between fields, naming the field OpenAI names (`param` of its error)."""
    return PydanticCustomError("invalid_value", message, {"param": param})


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_COMPLETION_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    stream: bool = False
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream_options: dict[str, Any] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None

    def stops(self) -> list[str] | None:
        """The stop strings as a list (a single string is one)."""
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else (self.stop or None)

    def sampling(self) -> dict[str, Any]:
        """The sampling arguments given, as the run's command names them. `top_p: 0` (a nucleus of
        the likeliest token alone) is greedy."""
        top_p, temperature = self.top_p, self.temperature
        if top_p == 0:
            top_p, temperature = None, 0.0
        args = {"max_new_tokens": self.max_tokens, "temperature": temperature, "top_p": top_p,
                "seed": self.seed, "stop": self.stops()}
        return {k: v for k, v in args.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    """POST /v1/completions."""
    prompt: str | list[str] | list[int] | list[list[int]]
    # OpenAI's default; 0 only with `echo` (score the prompt: lm-evaluation-harness's way)
    max_tokens: int | None = Field(16, ge=0, le=MAX_COMPLETION_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)  # accepted, not acted on

    @model_validator(mode="after")
    def _between_fields(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise refused("max_tokens", "max_tokens 0 needs `echo: true` (it only scores the prompt)")
        if self.best_of is not None and self.best_of < self.n:
            raise refused("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
        return self

    def prompts(self) -> list:
        """The prompts as a list of texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [p]
        if not p or len(p) > MAX_PROMPTS:
            raise ValueError(f"prompt: 1 to {MAX_PROMPTS} prompts")
        return list(p)

    def command(self) -> Complete:
        """The run's `complete` command for this request."""
        return Complete(prompts=self.prompts(), **self.sampling(), n=self.n, logprobs=self.logprobs is not None,
                        top_logprobs=self.logprobs or 0, echo=self.echo, stream=self.stream)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def plain(self) -> dict[str, str]:
        """{role, content} with the content as one string (text parts joined), `developer` as
        `system` (OpenAI's newer name for it)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Request):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COMPLETION_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _between_fields(self) -> "ChatRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise refused("top_logprobs", "top_logprobs needs `logprobs: true`")
        return self

    def command(self) -> Complete:
        args = self.sampling()
        if self.max_completion_tokens is not None:
            args["max_new_tokens"] = self.max_completion_tokens
        return Complete(messages=[m.plain() for m in self.messages], **args, n=self.n, logprobs=self.logprobs,
                        top_logprobs=self.top_logprobs or 0, stream=self.stream)


_WRONG_KIND = ("string_type", "list_type", "int_type", "float_type", "bool_type", "dict_type")


def first_problem(error: ValidationError) -> tuple[str, str]:
    """(the field at fault, what is wrong with it) of a pydantic error, for OpenAI's error body
    (`param`, `message`). Of a field that may be one of several kinds (`stop`: a string or a list),
    only what is wrong with the kind that was sent is told."""
    problems = error.errors()
    telling = [e for e in problems if e["type"] not in _WRONG_KIND] or problems
    if not telling:
        return "", "invalid request body"
    param = str((telling[0].get("ctx") or {}).get("param") or (telling[0]["loc"] or ("",))[0])
    text = "; ".join(f"{_where(e)}: {e['msg']}" for e in telling)
    return param, text


def _where(problem: Any) -> str:
    """The field's path, without pydantic's names of a union's branches (`stop.list[...]`)."""
    param = (problem.get("ctx") or {}).get("param")
    if param:
        return str(param)
    parts = [str(p) for p in problem["loc"] if isinstance(p, int) or "[" not in str(p) and str(p) != "str"]
    return ".".join(parts) or "body"
