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

from contract.events import state_event
from contract.protocol.states import RunState
from engine import checkpoint


def serve(trainer) -> None:
    """Load `control.chat_load` when given, then answer commands until a stop (every rank)."""
    cfg = trainer.config
    if cfg.control.chat_load:
        checkpoint.load_model(trainer.ctx, cfg.control.chat_load)  # an adapter lands on the base model
    trainer.engine.eval()
    trainer.control.paused = True  # the boundary holds (its own paused event below)
    trainer.emit(state_event(RunState.PAUSED, step=trainer.state.global_step, chat_only=True,
                             model=cfg.control.chat_load or cfg.resume or cfg.model.path or "default"))
    trainer.control.at_boundary()  # holds while paused: chat, evaluate, status ... until stop
    trainer.control.end_of_training()
    trainer.emit(state_event(RunState.FINISHED, step=trainer.state.global_step, chat_only=True))
