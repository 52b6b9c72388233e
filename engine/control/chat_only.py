"""A chat-only run (`control.chat_only`): the engine holds a model for chat and trains nothing.

This is how a finished run, a training checkpoint or an exported model is chatted with when no
run is live, and how a branch's checkpoint answers beside the live run.
It is an ordinary run, built by the same assembly in the same layout (one rank for a model
folder; the checkpoint's own layout for a training checkpoint, which `resume` restores), so
generation goes through the same collective handler as chat with a training run. It waits
paused at the control boundary until stopped; `resume` is refused, `stop` saves nothing; the
memory is freed when its process group ends.
"""

from __future__ import annotations

from typing import Any

from contract.config.schema import RunConfig
from engine import checkpoint
from engine.callbacks import Signal


def hold(trainer) -> Signal:
    """Load `control.chat_load` when given (every rank), and ask the loop to hold: a pause, in
    which the boundary answers chat, evaluate, status ... until a stop (Trainer._act carries it
    out; its `state` paused event names the model, `state_fields`)."""
    cfg = trainer.config
    if cfg.control.chat_load:
        checkpoint.load_model(trainer.ctx, cfg.control.chat_load)  # an adapter lands on the base model
    trainer.engine.eval()
    return Signal(pause=True, reason="chat only")


def state_fields(cfg: RunConfig) -> dict[str, Any]:
    """What a chat-only run's `state` paused event says besides the state: that it is one, and
    the model it holds (nothing for a training run)."""
    if not cfg.control.chat_only:
        return {}
    return {"chat_only": True, "model": cfg.control.chat_load or cfg.resume or cfg.model.path or "default"}
