"""Callbacks: objects that react to the trainer's events (CoLLie's hook names), and the Signal
they answer with.

Subclass :class:`Callback` and override the hooks you need; the trainer calls every callback in
the order given. A hook may return a :class:`Signal` -- stop, pause, rewind to X, skip -- and the
loop acts on it (as the Hugging Face Trainer's TrainerControl): no hook sets flags on the trainer
or swaps its parts. State a callback returns from `on_save_checkpoint` is stored in the training
checkpoint under the callback's `state_key` and handed back to `on_load_checkpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol


class Answer(Protocol):
    """The command that asked for a signal (the control plane's stop, pause, rewind, branch),
    answered by the loop once it has carried the signal out."""

    def done(self, outcome: Any = None) -> None:
        """Carried out; `outcome` is what the loop's act gave (a rewind's RewindResult)."""

    def failed(self, error: BaseException) -> None:
        """Refused or failed (nothing changed, or it was undone)."""


@dataclass(frozen=True)
class Signal:
    """What a hook, a command handler, the spike guard or early stopping asks of the loop; the
    loop (engine.trainer, `Trainer._act`) is the one that acts on it."""
    stop: bool = False               # end training after this step's boundary
    pause: bool = False              # hold at this step's boundary until a resume (the control plane)
    rewind: str | None = None        # go back to this checkpoint / snapshot now (Trainer.rewind) ...
    reason: str = "user"             # ... why (the rewind's event); also the pause's
    then_lr_scale: float | None = None  # ... and then scale the learning rate by this (the guard)
    branch: str | None = None        # ... and go on as this new branch (Trainer.branch) ...
    settings: dict[str, Any] | None = None  # ... with these settings changed (the branch command's)
    skip: bool = False               # (before the update) neither back-propagate nor apply the step:
    #                                  the step strategy carries it out (engine.steps), the rest of
    #                                  its signal goes on to the loop
    answer: Answer | None = None     # the command that asked: answered once the loop has acted

    def __or__(self, other: "Signal | None") -> "Signal":
        """Both signals' asks (the first rewind wins, with its branch and answer)."""
        if other is None:
            return self
        first = self if self.rewind is not None else other
        return replace(self, stop=self.stop or other.stop, pause=self.pause or other.pause,
                       skip=self.skip or other.skip, rewind=first.rewind, then_lr_scale=first.then_lr_scale,
                       branch=first.branch, settings=first.settings,
                       answer=first.answer if first.answer is not None else (self.answer or other.answer),
                       reason=first.reason if first.rewind is not None else
                       (self.reason if self.reason != "user" else other.reason))

    def without_skip(self) -> "Signal":
        """The signal less its skip (which the step itself carries out)."""
        return replace(self, skip=False)


NOTHING = Signal()  # a hook with nothing to ask


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
    def on_train_batch_end(self, trainer, loss: float) -> Signal | None: ...
    def on_before_backward(self, trainer, loss) -> Signal | None: ...  # the engine step, one micro-batch
    def on_before_optimizer_step(self, trainer) -> None: ...  # the engine step, gradients reduced
    def on_evaluate_begin(self, trainer) -> None: ...
    def on_evaluate_end(self, trainer, results: dict[str, float]) -> Signal | None: ...
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

    def fire(self, hook: str, trainer, *args) -> Signal:
        """Call `hook` of every callback; what they ask of the loop, together."""
        signal = NOTHING
        for cb in self.callbacks:
            answer = getattr(cb, hook)(trainer, *args)
            if isinstance(answer, Signal):
                signal = signal | answer
        return signal

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
