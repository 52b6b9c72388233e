"""The `complete` command: what the OpenAI-compatible API (supervisor.openai_api) asks of a run.
Import it through contract.protocol.

One command answers a `/v1/completions` or `/v1/chat/completions` request: several prompts (text
or token ids, as lm-evaluation-harness sends them) or one chat, `n` samples of each, stop strings,
nucleus sampling, a seed, the log-probabilities of the sampled tokens (`logprobs`, with the
`top_logprobs` most likely alternatives at each), and `echo`: the prompt's own tokens scored too.
`max_new_tokens: 0` with `echo` and `logprobs` only scores the prompt (how lm-evaluation-harness
computes log-likelihoods). Like `generate`, it runs on every rank at the next step boundary.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Field, model_validator

from contract.protocol.answers import Answer, CompleteAnswer
from contract.protocol.roles import Role
from contract.protocol.base import Chat, Command, StopStrings

MAX_COMPLETION_TOKENS = 4096  # per sample; the context caps it further (handler)
MAX_PROMPTS = 64       # prompts in one request (lm-evaluation-harness batches send several)
MAX_SAMPLES = 16       # `n`: samples of each prompt
MAX_TOP_LOGPROBS = 20  # alternatives listed at each token (OpenAI's limit)


def _prompts(prompts: list) -> list:
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise ValueError(f"`prompts` must hold 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
    for i, p in enumerate(prompts):
        text = isinstance(p, str)
        ids = isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
        if not (text or ids) or not p:
            raise ValueError(f"prompts[{i}] must be a non-empty string or a non-empty list of token ids "
                             "(integers >= 0)")
    return prompts


class Complete(Command):
    """Complete `prompts` (each text or a list of token ids) or answer the chat `messages`, with
    the live weights; optionally with token log-probabilities. Its parameters left at None take
    the run's chat defaults (`set generation={...}`)."""

    name: ClassVar[str] = "complete"
    returns: ClassVar[type[Answer]] = CompleteAnswer
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
    prompts: Annotated[list, AfterValidator(_prompts)] | None = Field(
        default=None, description="Texts or token-id lists the model continues (or give `messages`).")
    messages: Chat | None = Field(default=None, description="A chat: [{role: system|user|assistant, content}] (or give "
                                  "`prompts`).")
    max_new_tokens: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_TOKENS, description="Most tokens to "
                                       "generate per sample; 0: none (with `echo`: only score the prompt).")
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, description="Sampling temperature; 0 is greedy.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int | None = Field(default=None, ge=0, le=1 << 20, description="Keep only the k most likely tokens; 0: all.")
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0, description="Penalty on tokens already "
                                             "generated; 1: none.")
    stop: StopStrings | None = Field(default=None, description="Strings that end a sample (not included in it).")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, description="Sampling seed; none: a fresh one, reported "
                             "in the answer.")
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES, description="Samples of each prompt.")
    logprobs: bool = Field(default=False, description="Return each sampled token's log-probability.")
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS, description="With `logprobs`: the most likely "
                              "alternatives at each token.")
    echo: bool = Field(default=False, description="Put the prompt in front of the text (and, with `logprobs`, "
                       "score its tokens).")
    stream: bool = Field(default=False, description="Stream the text of a single sample token by token.")

    @model_validator(mode="after")
    def _prompts_or_chat(self) -> Complete:
        if (self.prompts is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompts` or `messages`")
        if self.max_new_tokens == 0 and not self.echo:
            raise ValueError("max_new_tokens 0 needs `echo` (it only scores the prompt)")
        return self

    def sampling(self) -> dict[str, Any]:
        """The generation parameters given (not None), by name, as `generate` takes them."""
        names = ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "stop", "seed")
        return self.model_dump(include=set(names), exclude_none=True)
