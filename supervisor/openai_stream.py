"""Pieces of the OpenAI-compatible API's answers (supervisor.openai_api): server-sent events,
chat stream chunks, chat log-probabilities, and the stop-string filter of a stream. Torch-free."""

from __future__ import annotations

import json


def sse(data: dict | str) -> str:
    """One server-sent event, as OpenAI streams them (`data: <json>` and a blank line)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def chat_chunk(index: int, delta: dict) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


def chat_logprobs(logprobs: dict | None) -> dict | None:
    """OpenAI's chat `logprobs` ({"content": [{token, logprob, bytes, top_logprobs}]}) from the
    completions form the run answers with."""
    if logprobs is None:
        return None
    content = []
    for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        alternatives = [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in (top or {}).items()]
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": alternatives})
    return {"content": content}


class StopFilter:
    """Streams text up to the first stop string: the end of the text that may begin a stop string
    is held back until the next piece shows whether it does."""

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in stops or [] if s]
        self.buffer, self.stopped = "", False

    def feed(self, text: str) -> str:
        """The part of the text so far that can be sent now."""
        if self.stopped:
            return ""
        self.buffer += text
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buffer, self.stopped = self.buffer[:min(hits)], "", True
            return out
        cut = len(self.buffer) - self._held()
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out

    def _held(self) -> int:
        """The length of the longest end of the buffer that begins a stop string."""
        for n in range(min(len(self.buffer), max((len(s) for s in self.stops), default=0)), 0, -1):
            if any(s.startswith(self.buffer[-n:]) for s in self.stops):
                return n
        return 0
