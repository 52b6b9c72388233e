"""Callbacks: objects that react to the trainer's events (CoLLie's hook names).

Subclass :class:`Callback` and override the hooks you need; the trainer calls every callback in
the order given. State a callback returns from `on_save_checkpoint` is stored in the training
checkpoint under the callback's `state_key` and handed back to `on_load_checkpoint`.
"""

from __future__ import annotations

from typing import Any


class Callback:
    @property
    def state_key(self) -> str:
        return type(self).__name__

    def on_after_trainer_initialized(self, trainer) -> None: ...
    def on_setup_parallel_model(self, trainer) -> None: ...
    def on_train_begin(self, trainer) -> None: ...
    def on_train_end(self, trainer) -> None: ...
    def on_train_epoch_begin(self, trainer) -> None: ...
    def on_train_epoch_end(self, trainer) -> None: ...
    def on_train_batch_begin(self, trainer, batch: list) -> None: ...
    def on_train_batch_end(self, trainer, loss: float) -> None: ...
    def on_evaluate_begin(self, trainer) -> None: ...
    def on_evaluate_end(self, trainer, results: dict[str, float]) -> None: ...
    def on_save_model(self, trainer, path: str) -> None: ...
    def on_load_model(self, trainer, path: str) -> None: ...
    def on_save_checkpoint(self, trainer) -> Any: return None
    def on_load_checkpoint(self, trainer, state: Any) -> None: ...


class CallbackList:
    """Delivers each hook to every callback, in order."""

    def __init__(self, callbacks: list[Callback] | tuple = ()):
        self.callbacks = list(callbacks)

    def __iter__(self):
        return iter(self.callbacks)

    def fire(self, hook: str, trainer, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(trainer, *args)

    def state_dict(self, trainer) -> dict[str, Any]:
        states = {}
        for cb in self.callbacks:
            state = cb.on_save_checkpoint(trainer)
            if state is not None:
                states[cb.state_key] = state
        return states

    def load_state_dict(self, trainer, states: dict[str, Any]) -> None:
        for cb in self.callbacks:
            if cb.state_key in states:
                cb.on_load_checkpoint(trainer, states[cb.state_key])
