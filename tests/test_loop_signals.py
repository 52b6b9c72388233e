"""Hooks answer with a Signal and the loop acts on it (engine.callbacks): how the answers of
several callbacks combine. The loop's acting on them runs in the real-run tests (early stopping,
the spike guard, rewinds, stop)."""

from engine.callbacks import NOTHING, Callback, CallbackList, Signal


def test_signals_combine_every_ask_and_the_first_rewind_wins():
    both = Signal(stop=True) | Signal(pause=True, reason="guard: loss_spike")
    assert (both.stop, both.pause, both.skip, both.rewind, both.reason) == (True, True, False, None, "guard: loss_spike")
    first = Signal(rewind="step-4", reason="guard: grad_norm", then_lr_scale=0.5) | Signal(rewind="step-2")
    assert (first.rewind, first.reason, first.then_lr_scale) == ("step-4", "guard: grad_norm", 0.5)
    assert (NOTHING | Signal(rewind="s2")).rewind == "s2" and (NOTHING | None) == NOTHING


def test_a_hook_list_gathers_the_signals_and_ignores_other_answers():
    class Stops(Callback):
        def on_evaluate_end(self, trainer, results):
            return Signal(stop=True)

    class Chatty(Callback):
        def on_evaluate_end(self, trainer, results):
            return "not a signal"  # a CoLLie-style hook's return value means nothing to the loop

    class Skips(Callback):
        def on_before_backward(self, trainer, loss):
            return Signal(skip=True)

    hooks = CallbackList([Chatty(), Stops(), Skips()])
    assert hooks.fire("on_evaluate_end", None, {}) == Signal(stop=True)
    assert hooks.fire("on_before_backward", None, 1.0).skip
    assert hooks.fire("on_train_begin", None) == NOTHING
