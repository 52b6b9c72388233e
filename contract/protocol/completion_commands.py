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

from dataclasses import dataclass
from typing import Any, ClassVar

from contract.protocol.roles import Role
from contract.protocol.base import Command, ProtocolError, _arg, check_messages

MAX_COMPLETION_TOKENS = 4096  # per sample; the context caps it further (handler)
MAX_PROMPTS = 64       # prompts in one request (lm-evaluation-harness batches send several)
MAX_SAMPLES = 16       # `n`: samples of each prompt
MAX_TOP_LOGPROBS = 20  # alternatives listed at each token (OpenAI's limit)


@dataclass(frozen=True)
class Complete(Command):
    """Complete `prompts` (each text or a list of token ids) or answer the chat `messages`, with
    the live weights; optionally with token log-probabilities. Its parameters left at None take
    the run's chat defaults (`set generation={...}`)."""

    name: ClassVar[str] = "complete"
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
    prompts: list | None = _arg(None, "Texts or token-id lists the model continues (or give `messages`).")
    messages: list[dict[str, str]] | None = _arg(
        None, "A chat: [{role: system|user|assistant, content}] (or give `prompts`).")
    max_new_tokens: int | None = _arg(None, "Most tokens to generate per sample; 0: none (with `echo`: "
                                      "only score the prompt).", minimum=0, maximum=MAX_COMPLETION_TOKENS)
    temperature: float | None = _arg(None, "Sampling temperature; 0 is greedy.", minimum=0.0, maximum=100.0)
    top_p: float | None = _arg(None, "Nucleus sampling mass.", minimum=0.0, maximum=1.0, exclusive_minimum=True)
    top_k: int | None = _arg(None, "Keep only the k most likely tokens; 0: all.", minimum=0, maximum=1 << 20)
    repetition_penalty: float | None = _arg(None, "Penalty on tokens already generated; 1: none.",
                                            minimum=0.0, maximum=100.0, exclusive_minimum=True)
    stop: list[str] | None = _arg(None, "Strings that end a sample (not included in it).")
    seed: int | None = _arg(None, "Sampling seed; none: a fresh one, reported in the answer.",
                            minimum=0, maximum=2**63 - 1)
    n: int = _arg(1, "Samples of each prompt.", minimum=1, maximum=MAX_SAMPLES)
    logprobs: bool = _arg(False, "Return each sampled token's log-probability.")
    top_logprobs: int = _arg(0, "With `logprobs`: the most likely alternatives at each token.",
                             minimum=0, maximum=MAX_TOP_LOGPROBS)
    echo: bool = _arg(False, "Put the prompt in front of the text (and, with `logprobs`, score its tokens).")
    stream: bool = _arg(False, "Stream the text of a single sample token by token.")

    def _check(self) -> None:
        if (self.prompts is None) == (self.messages is None):
            raise ProtocolError("complete: give exactly one of `prompts` or `messages`")
        if self.messages is not None:
            check_messages(self.messages)
        else:
            _check_prompts(self.prompts or [])
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ProtocolError("complete: argument 'stop' must be a list of non-empty strings")
        if self.max_new_tokens == 0 and not self.echo:
            raise ProtocolError("complete: max_new_tokens 0 needs `echo` (it only scores the prompt)")

    def sampling(self) -> dict[str, Any]:
        """The generation parameters given (not None), by name, as `generate` takes them."""
        names = ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "stop", "seed")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


def _check_prompts(prompts: list) -> None:
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise ProtocolError(f"complete: `prompts` must hold 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
    for i, p in enumerate(prompts):
        text = isinstance(p, str)
        ids = isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
        if not (text or ids) or not p:
            raise ProtocolError(f"complete: prompts[{i}] must be a non-empty string or a non-empty list of "
                                "token ids (integers >= 0)")
