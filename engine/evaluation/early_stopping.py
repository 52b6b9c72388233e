"""Early stopping: end training when evaluations stop improving.

A callback, composed into every run whose config asks for it (`eval.early_stopping_patience`
above 0): after each evaluation it compares `checkpoint.monitor` (the metric the best
checkpoints are ranked by, in its `checkpoint.mode`) with the best value so far. An improvement
by more than `eval.early_stopping_threshold` resets the count; `patience` evaluations in a row
without one return a stop Signal, on which the loop ends the run after the current step (an
`early_stop` event says why). The end of the run
then goes as always: the final checkpoint and model, and the best checkpoint's weights loaded
when `checkpoint.load_best_at_end` (the Hugging Face Trainer's EarlyStoppingCallback works the
same way). The count is stored in training checkpoints, so a resumed run stops where the
uninterrupted one would. Evaluation results are the same on every rank, so every rank decides
alike without a collective.
"""

from __future__ import annotations

import math
from typing import Any

from engine.callbacks import Callback, Signal
from contract.events import EarlyStopEvent, WarningEvent


class EarlyStopping(Callback):
    def __init__(self, metric: str, mode: str, patience: int, threshold: float = 0.0):
        if patience < 1:
            raise ValueError(f"eval.early_stopping_patience must be at least 1, got {patience}")
        self.metric = metric if metric.startswith("eval/") else f"eval/{metric}"
        self.mode, self.patience, self.threshold = mode, patience, threshold
        self.best: float | None = None
        self.best_step = -1
        self.without_improvement = 0
        self.stopped = False

    @classmethod
    def from_config(cls, cfg) -> "EarlyStopping | None":
        if not cfg.eval.early_stopping_patience:
            return None
        return cls(cfg.checkpoint.monitor, cfg.checkpoint.mode, cfg.eval.early_stopping_patience,
                   cfg.eval.early_stopping_threshold)

    def improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "max":
            return value > self.best + self.threshold
        return value < self.best - self.threshold

    def on_evaluate_end(self, trainer, results: dict[str, float]) -> Signal | None:
        """Count this evaluation; a stop signal (and the `early_stop` event) once `patience`
        evaluations in a row did not improve."""
        value = results.get(self.metric[len("eval/"):])
        if value is None:
            trainer.emit(WarningEvent(message=f"early stopping watches {self.metric}, which "
                                      f"this evaluation did not report (it reported: {', '.join(sorted(results))})"))
            return
        step = trainer.state.global_step
        if self.improves(float(value)):
            self.best, self.best_step, self.without_improvement = float(value), step, 0
            return
        self.without_improvement += 1
        if self.without_improvement < self.patience:
            return None
        if not self.stopped:  # said once; the loop stops after this step's boundary
            self.stopped = True
            trainer.emit(EarlyStopEvent(step=step, metric=self.metric, value=float(value),
                                        best=self.best, best_step=self.best_step, patience=self.patience,
                                        threshold=self.threshold))
        return Signal(stop=True, reason="early stopping")

    def on_save_checkpoint(self, trainer) -> Any:
        return {"best": self.best, "best_step": self.best_step, "without_improvement": self.without_improvement}

    def on_load_checkpoint(self, trainer, state: Any) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.without_improvement = state["without_improvement"]
