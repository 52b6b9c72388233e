"""The request bodies of the OpenAI-compatible API (supervisor.openai_api), as pydantic v2 models,
and how each becomes the run's `complete` command (contract.protocol.completion_commands.Complete).

Fields the API does not act on (`user`, `presence_penalty`, `logit_bias`, ...) are accepted and
ignored, as most OpenAI-compatible servers do, so clients that always send them work.
Torch-free.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract.protocol.completion_commands import MAX_PROMPTS, MAX_SAMPLES, MAX_TOP_LOGPROBS, Complete

MAX_STOP = 4  # stop strings per request (OpenAI's limit)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream_options: dict[str, Any] | None = None

    def stops(self) -> list[str] | None:
        """The stop strings as a list (a single string is one)."""
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > MAX_STOP or not all(stops):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings")
        return stops or None

    def sampling(self) -> dict[str, Any]:
        """The sampling arguments given, as the run's command names them."""
        args = {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed, "stop": self.stops()}
        return {k: v for k, v in args.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    """POST /v1/completions."""
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

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
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def command(self) -> Complete:
        args = self.sampling()
        if self.max_completion_tokens is not None:
            args["max_new_tokens"] = self.max_completion_tokens
        return Complete(messages=[m.plain() for m in self.messages], **args, n=self.n, logprobs=self.logprobs,
                        top_logprobs=self.top_logprobs or 0, stream=self.stream)


def first_problem(error: ValidationError) -> tuple[str, str]:
    """(the field at fault, what is wrong with it) of a pydantic error, for OpenAI's error body."""
    problems = error.errors()
    where = ".".join(str(p) for p in problems[0]["loc"]) if problems else ""
    text = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in problems)
    return where, text
