"""Pieces of the OpenAI-compatible API's answers (supervisor.openai_api): the run's messages
handed onto the event loop, server-sent events, OpenAI's response and stream objects (`Made`),
chat log-probabilities, and the stop-string filter of a stream. Torch-free.

No thread waits for the run on a request's behalf: the run client's reader thread hands each
message to the event loop (`LoopAnswers`), which sends it on as the next server-sent event. Each
hand-over between threads costs a scheduling wake-up, and on a machine whose cores the training
ranks keep busy every wake-up waits its turn (a thread-pool worker per piece cost the first token
tens of milliseconds there)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from contract.protocol.answers import CompleteAnswer
from contract.protocol.completion_commands import Complete
from contract.protocol.frames import Done, Error, Frame, Token
from supervisor.client import CommandError, parsed


class RunFailed(RuntimeError):
    """The run answered the request with an error (its message), or the connection to it was lost."""


class LoopAnswers:
    """The messages answering one request, put by the run client's reader thread
    (RunClient.submit) and read on the event loop: iterate for the streamed texts; afterwards
    `result` holds the run's reply, parsed into its answer model (CompleteAnswer, as the client
    parses every answer). Raises RunFailed, or TimeoutError when no message comes for `timeout`
    seconds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float):
        self._loop, self._timeout = loop, timeout
        self._queue: asyncio.Queue[Frame] = asyncio.Queue()
        self.result: CompleteAnswer | None = None
        self.answered_by: tuple[int | None, int | None] = (None, None)  # (step, seed) of the weights
        # and sample, from the first piece on

    def put(self, message: Frame) -> None:
        """From any thread: hand `message` to the loop (gone with its server: nobody waits)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, message)
        except RuntimeError:  # the loop has closed; the client's reader thread must go on
            pass

    async def texts(self) -> AsyncIterator[str]:
        while self.result is None:
            try:
                message = await asyncio.wait_for(self._queue.get(), self._timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no answer from the run within {self._timeout} s") from None
            if isinstance(message, Token):
                if message.step is not None:
                    self.answered_by = (message.step, message.seed)
                yield message.text
            elif isinstance(message, Done):
                try:
                    self.result = parsed(CompleteAnswer, message.result)
                except CommandError as e:  # a run of another version
                    raise RunFailed(str(e)) from None
                self.answered_by = (self.result.step, self.result.seed)
            elif isinstance(message, Error):
                raise RunFailed(message.message)

    def answer(self) -> CompleteAnswer:
        """The run's answer, once `texts()` has ended."""
        if self.result is None:
            raise RunFailed("the run has not answered yet")
        return self.result

    async def first(self) -> list[str]:
        """The first streamed text (none when the answer came whole), so that a refusal is answered
        with its status before any byte of a stream is sent."""
        async for text in self.texts():
            return [text]
        return []


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


class Made:
    """Turns the run's `complete` results into OpenAI's response and stream objects."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat, self.created = model, chat, int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, kind: str, fingerprint: str | None = None) -> dict[str, Any]:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return head if fingerprint is None else {**head, "system_fingerprint": fingerprint}

    def response(self, result: CompleteAnswer) -> dict:
        choices = [self._choice(c) for c in result.choices]
        usage = {**result.usage, "total_tokens": result.usage.get("prompt_tokens", 0)
                 + result.usage.get("completion_tokens", 0)}
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind, _fingerprint(result.step, result.seed)), "choices": choices, "usage": usage}

    def _choice(self, c: dict) -> dict:
        if self.chat:
            return {"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                    "finish_reason": c["finish_reason"], "logprobs": chat_logprobs(c.get("logprobs"))}
        text = (c["prompt"] or "") + c["text"] if c.get("prompt") is not None else c["text"]
        logprobs = c.get("logprobs")
        if logprobs is not None:
            logprobs = {k: v for k, v in logprobs.items() if k != "token_ids"}
        return {"index": c["index"], "text": text, "finish_reason": c["finish_reason"], "logprobs": logprobs}

    async def stream(self, answers: LoopAnswers, first: list[str], command: Complete,
                     include_usage: bool) -> AsyncIterator[str]:
        """The SSE stream: the pieces as the run streams them (held back where a stop string may
        begin), then every choice's rest and finish reason, `[DONE]` last. Every chunk carries
        `system_fingerprint` (the step and seed that answer: the run names them with its first
        piece, which has come before the stream starts)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        stops, sent = StopFilter(command.stop), ""
        head = self._head(kind, _fingerprint(*answers.answered_by))
        if self.chat:
            yield sse({**head, "choices": [chat_chunk(0, {"role": "assistant", "content": ""})]})
        try:
            for piece in first:
                text = stops.feed(piece)
                if text:
                    sent += text
                    yield sse({**head, "choices": [self._delta(0, text)]})
            async for piece in answers.texts():
                text = stops.feed(piece)
                if text:
                    sent += text
                    yield sse({**head, "choices": [self._delta(0, text)]})
        except (RunFailed, TimeoutError) as e:
            yield sse({"error": {"message": str(e), "type": "service_unavailable", "param": None, "code": None}})
            yield sse("[DONE]")
            return
        result = answers.answer()
        head = self._head(kind, _fingerprint(result.step, result.seed))
        for c in self.response(result)["choices"]:
            whole = c["message"]["content"] if self.chat else c["text"]
            rest = whole[len(sent):] if c["index"] == 0 and whole.startswith(sent) else whole
            if rest:
                yield sse({**head, "choices": [self._delta(c["index"], rest)]})
            end = self._delta(c["index"], None)
            end["finish_reason"] = c["finish_reason"]
            yield sse({**head, "choices": [end]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": self.response(result)["usage"]})
        yield sse("[DONE]")

    def _delta(self, index: int, text: str | None) -> dict:
        if self.chat:
            return chat_chunk(index, {} if text is None else {"content": text})
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": None}


def _fingerprint(step: int | None, seed: int | None) -> str | None:
    """Which weights answered: the training step (and the seed a sample can be repeated with);
    None before the run has named them."""
    if step is None:
        return None
    return f"step-{step}-seed-{seed}"
