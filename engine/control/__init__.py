"""The live control plane: chat with the weights being trained, pause, set, save, stop.

    rank 0: ControlServer (socket thread) -> CommandQueue
    every rank, at each step boundary: Boundary.exchange() -> handlers, in the same order

Two ways in: `attach(trainer)` on a built Trainer (what `Trainer(server=True)` does, with the
chat page), or `ControlCallback()` in the callbacks a run is built with (what the worker does
when `control.enabled`). Protocol: contract.protocol; client: supervisor.client.RunClient.

Behaviour a user can count on:
- Every accepted command is answered: `done` with its result, or `error` with the reason
  (refused in the run's state, failed, or the run ended before it could run). It is recorded in
  events.jsonl (queued, then done / failed) before its sender hears the answer.
- Commands run between optimizer steps (after the step, with gradient accumulation after the
  last micro-batch), before the first step, and once more after the last one.
- `pause` keeps everything in memory; chat, evaluate, save, set and status work while paused.
  A pause that arrives at the very end holds the finished weights for chat until resume / stop.
- Once training has ended the run takes no new commands (a clear error says so); `status` and
  `subscribe` answer until the process exits.
- `stop` saves by default: a training checkpoint at once, and the final model when the run ends;
  `stop(save=false)` saves neither. A failed save fails the stop, so nothing is lost.
- `status` is answered at once with rank 0's memory; `status(ranks=true)` waits for the
  boundary and gathers every rank's.
- `set` changes are kept in one `LiveSettings` object (engine.control.settings; also
  `trainer.live_settings`), never in the run config; recorded as `set` events, stored in every
  training checkpoint (this callback's state) and applied again on resume. The loop reads its
  eval / checkpoint schedule and the final save from it: `live_settings(trainer).eval_every(cfg)`.
- Commands are contract.protocol models from the socket to the handler: each handler
  receives its typed command (engine.control.handlers.HANDLERS, keyed by command type).
"""

from __future__ import annotations

from typing import Any

from engine.callbacks import Callback
from engine.control.plane import HEARTBEAT_S, Control
from engine.control.settings import LiveSettings, live_settings

__all__ = ["attach", "Control", "ControlCallback", "HEARTBEAT_S", "LiveSettings", "live_settings"]


def attach(trainer, chat_page: bool = False) -> Control:
    """Open the control plane on a built trainer (every rank calls it); returns it."""
    existing = getattr(trainer, "control", None)
    if existing is not None:
        return existing
    callback = ControlCallback(chat_page=chat_page)
    trainer.callbacks.callbacks.append(callback)
    callback.start(trainer)
    return trainer.control


class ControlCallback(Callback):
    """Runs the control plane's step boundaries from the trainer's hooks. Built before the
    trainer (the worker passes it in `callbacks=`); it starts once the trainer exists. Only one
    control plane per trainer: a second callback finds `trainer.control` taken and stays idle."""

    def __init__(self, chat_page: bool = False):
        self.chat_page = chat_page
        self.control: Control | None = None

    @property
    def state_key(self) -> str:
        return "control"

    def start(self, trainer) -> None:
        if getattr(trainer, "control", None) is None:
            self.control = trainer.control = Control(trainer, chat_page=self.chat_page)

    def on_after_trainer_initialized(self, trainer) -> None:
        self.start(trainer)

    def on_train_begin(self, trainer) -> None:
        if self.control is not None:  # a pause sent before the first step holds it back
            self.control.at_boundary()

    def on_train_batch_end(self, trainer, loss: float) -> None:
        if self.control is not None:
            self.control.at_boundary()

    def on_train_end(self, trainer) -> None:
        if self.control is not None:
            self.control.end_of_training()

    def on_save_checkpoint(self, trainer) -> Any:
        return self.control.state_dict() if self.control is not None else None

    def on_load_checkpoint(self, trainer, state: Any) -> None:
        if self.control is not None and isinstance(state, dict):
            self.control.load_state_dict(state)
