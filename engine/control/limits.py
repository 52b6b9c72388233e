"""What the control server bounds, and where each bound is set (the README copies this list).

The limits (module constants; tests pass others to ControlServer(**limits)):

- MAX_CONNECTIONS = 64 open connections. Past it a new connection gets one error line,
  "refused: ... connections open", and is closed. LISTEN_BACKLOG = 1024 (bursts of hundreds of
  connections at once are accepted, then served or refused, never left to the kernel).
- READ_TIMEOUT_S = 10: a message must arrive whole within 10 s of its first byte; a client that
  sends half a line and then nothing is told so and disconnected.
- IDLE_TIMEOUT_S = 300: a connection with no subscription and no command waiting for its answer
  that sends nothing for 5 minutes is closed (supervisor.client reconnects on its next call).
- MAX_MESSAGE_BYTES = 1 MiB per message (contract.protocol); larger lines are refused and skipped.
- MAX_ID_CHARS = 256: the request id is echoed in every answer, so it is kept short.
- MAX_PENDING = 256 commands queued through this server and not yet answered (all connections
  together); past it a command is refused at once.
- Send buffer per client: events are fed only while less than SEND_HIGH_WATER = 256 KiB waits
  for the client; answers are never held back. A client whose unsent data passes
  SEND_BUFFER_MAX = 4 MiB, or that has taken nothing for STALL_TIMEOUT_S = 30 s while the buffer
  sat above the high-water mark, is dropped: an error line saying why is its last message
  (readable for DROP_GRACE_S = 5 s if it starts reading), and the drop is listed in `status`
  under `control.dropped` (peer, request ids, reason), where it can read it when it reconnects.
  The kernel's send buffer of each connection is set to KERNEL_SNDBUF = 256 KiB.
- Hostile messages (malformed JSON or UTF-8, nesting too deep for the parser, numbers too large
  for a float, unknown fields) are answered with an error, like any other bad message.
- `close()` (stop, the natural end of a run) waits for no client: it feeds subscribers what is
  left, gives every connection CLOSE_GRACE_S = 1 s in total to take it, and cuts the rest.
- One subscription per connection (a second `subscribe` on it is refused: open another).
- `generate` (with `PromptLimit`, built by the control plane): a prompt whose tokens fill the
  model's context is refused at once, before it is queued, naming the limit (text longer than
  CHARS_PER_TOKEN = 32 characters per context token is refused without being tokenized);
  `max_new_tokens` is capped to the room left, so a chat generates at most context - prompt
  tokens (255 for the default model, whose context is 256), twice that with `compare_base`.
  The context: the model config's max_position_embeddings (or n_positions, ...), else the
  tokenizer's model_max_length, else DEFAULT_CONTEXT_TOKENS = 4096.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from contract.protocol.commands import Generate
from contract.protocol.wire import MAX_MESSAGE_BYTES
from contract.protocol.base import Command, ProtocolError

MAX_CONNECTIONS = 64
LISTEN_BACKLOG = 1024
READ_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 300.0
MAX_ID_CHARS = 256
MAX_PENDING = 256
SEND_HIGH_WATER = 256 * 1024
SEND_BUFFER_MAX = 4 * 1024 * 1024
STALL_TIMEOUT_S = 30.0
DROP_GRACE_S = 5.0
KERNEL_SNDBUF = 256 * 1024
CLOSE_GRACE_S = 1.0
FEED_TURN_BYTES = 1024 * 1024  # events sent to one subscriber before the loop serves the others
SWEEP_S = 0.25  # how often timeouts are checked (and lines written by other processes fed)


class Limits:
    """The server's limits (defaults: the module constants); tests shorten the timeouts."""

    def __init__(self, **overrides: float):
        self.max_connections = int(overrides.pop("max_connections", MAX_CONNECTIONS))
        self.read_timeout = overrides.pop("read_timeout", READ_TIMEOUT_S)
        self.idle_timeout = overrides.pop("idle_timeout", IDLE_TIMEOUT_S)
        self.stall_timeout = overrides.pop("stall_timeout", STALL_TIMEOUT_S)
        self.send_buffer_max = int(overrides.pop("send_buffer_max", SEND_BUFFER_MAX))
        self.max_pending = int(overrides.pop("max_pending", MAX_PENDING))
        self.drop_grace = overrides.pop("drop_grace", DROP_GRACE_S)
        if overrides:
            raise TypeError(f"unknown limits: {', '.join(overrides)}")

    def as_dict(self) -> dict[str, float]:
        return {"max_connections": self.max_connections, "read_timeout_s": self.read_timeout,
                "idle_timeout_s": self.idle_timeout, "stall_timeout_s": self.stall_timeout,
                "send_buffer_max_bytes": self.send_buffer_max, "send_high_water_bytes": SEND_HIGH_WATER,
                "max_pending": self.max_pending, "max_message_bytes": MAX_MESSAGE_BYTES,
                "drop_grace_s": self.drop_grace}


DEFAULT_CONTEXT_TOKENS = 4096  # the prompt cap of a model whose context length is not known


def context_tokens(model: Any, tokenizer: Any) -> int:
    """The model's context in tokens: its config's position count, else the tokenizer's
    model_max_length when that is a real limit, else DEFAULT_CONTEXT_TOKENS."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    return value if isinstance(value, int) and 0 < value < 10**7 else DEFAULT_CONTEXT_TOKENS


class PromptLimit:
    """Keeps `generate` within the model's context: a prompt that alone fills the context is
    refused at once (before it is queued), naming the limit; `max_new_tokens` is capped so that
    prompt + answer fit. `count_tokens(args)` counts the prompt's tokens as the handler will
    build it; `default_new_tokens()` is the live default of max_new_tokens."""


    CHARS_PER_TOKEN = 32  # longer text is refused before it is even tokenized

    def __init__(self, context_tokens: int, count_tokens: Callable[[Command], int],
                 default_new_tokens: Callable[[], int]):
        self.context, self.count_tokens, self.default_new_tokens = context_tokens, count_tokens, default_new_tokens

    @classmethod
    def of(cls, model: Any, tokenizer: Any, prompt_text: Callable[[Any, Any], str],
           default_new_tokens: Callable[[], int]) -> "PromptLimit":
        """The limit of `model`'s context, counting the tokens of `prompt_text(tokenizer, args)`
        (the text generation will encode, special tokens included)."""
        tokenizer = copy.deepcopy(tokenizer)  # its own: a tokenizer is not safe across threads
        def count(command: Command) -> int:
            text = prompt_text(tokenizer, command)
            return len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return cls(context_tokens(model, tokenizer), count, default_new_tokens)

    def __call__(self, command: Command) -> Command:
        if not isinstance(command, Generate):
            return command
        ctx = self.context
        chars = len(command.prompt or "") + sum(len(m.get("content", "")) for m in command.messages or ())
        if chars > ctx * self.CHARS_PER_TOKEN:
            raise ProtocolError(f"generate: the prompt has {chars} characters, far more than the model's "
                                f"context of {ctx} tokens holds; shorten it")
        n = self.count_tokens(command)
        if n >= ctx:
            raise ProtocolError(f"generate: the prompt is {n} tokens, and the model's context is {ctx} "
                                "tokens (prompt and answer together); shorten it")
        wanted = command.max_new_tokens or self.default_new_tokens()
        return command.model_copy(update={"max_new_tokens": ctx - n}) if wanted > ctx - n else command
