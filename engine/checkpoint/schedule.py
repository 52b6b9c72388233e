"""The checkpoint schedule and the best-model reload, as trainer callbacks.

`CheckpointCallback` saves a training checkpoint to the run's `checkpoints/step-<N>` every n
steps and/or every n epochs (read live from the run config, so the control plane's
`save_every_n_steps` takes effect at once) and, when a schedule is on, once more at the end of
training. When an evaluation falls on the same step, the save waits for it so that the
checkpoint carries that step's metrics. After each save the rules run on what is on disk:

- keep the newest `keep_last` scheduled checkpoints (0 keeps all),
- and the best `keep_best` by `monitor` (`mode` min or max), among the checkpoints evaluated at
  their own step (a checkpoint between evaluations has no metric and is not ranked),
- and always the newest one (`last`, the one `latest` names);

every other scheduled checkpoint is deleted. Checkpoints saved by hand (the control plane's
`save`, `stop`) are never deleted by these rules. Because the rules read the markers on disk,
they hold across resumes without any state of their own.

`LoadBestModelCallback` reloads the best checkpoint's weights when training ends (before the
final model is exported), leaving the trainer's position as it is.
"""

from __future__ import annotations

import math
from typing import Any

from engine.callbacks import Callback
from engine.checkpoint import atomic, state
from contract.config import RunConfig

SCHEDULE = "schedule"


def checkpoint_name(step: int) -> str:
    return f"step-{step}"


def _due(count: int, every: int) -> bool:
    return every > 0 and count > 0 and count % every == 0


def metric_of(metrics: dict, monitor: str) -> float | None:
    """The monitored value from a record of metrics (`eval/loss` or `loss` both find it)."""
    for key in (monitor, monitor.removeprefix("eval/"), f"eval/{monitor}"):
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def to_delete(checkpoints: list[dict], keep_last: int, keep_best: int, monitor: str, mode: str) -> list[str]:
    """Names of the scheduled checkpoints the rules drop (see the module docstring).
    `checkpoints`: markers with "name", "step", "saved_by", "metrics"."""
    scheduled = sorted((c for c in checkpoints if c.get("saved_by") == SCHEDULE), key=lambda c: c["step"])
    if not scheduled:
        return []
    keep = {scheduled[-1]["name"]}
    keep |= {c["name"] for c in (scheduled if keep_last == 0 else scheduled[-keep_last:])}
    ranked = [c for c in scheduled if metric_of(c.get("metrics", {}), monitor) is not None]
    sign = 1.0 if mode == "min" else -1.0
    ranked.sort(key=lambda c: (sign * metric_of(c["metrics"], monitor), -c["step"]))  # ties: newer wins
    keep |= {c["name"] for c in ranked[:keep_best]}
    return [c["name"] for c in scheduled if c["name"] not in keep]


def best_checkpoint(checkpoints: list[dict], monitor: str, mode: str) -> dict | None:
    ranked = [c for c in checkpoints if metric_of(c.get("metrics", {}), monitor) is not None]
    if not ranked:
        return None
    sign = 1.0 if mode == "min" else -1.0
    return min(ranked, key=lambda c: (sign * metric_of(c["metrics"], monitor), -c["step"]))


class CheckpointCallback(Callback):
    """Saves on the run's schedule and applies keep-last / keep-best (module docstring)."""

    def __init__(self, save_last: bool = True):
        self.save_last = save_last
        self.metrics: dict[str, Any] = {}
        self.metrics_step: int | None = None  # the step `metrics` were measured at
        self._pending_step: int | None = None
        self._saved_step: int | None = None

    def on_train_batch_end(self, trainer, loss: float) -> None:
        step, cfg = trainer.state.global_step, trainer.config
        if not _due(step, cfg.checkpoint.every_n_steps):
            return
        if trainer.eval_dataset is not None and _due(step, cfg.eval.every_n_steps):
            self._pending_step = step  # the evaluation of this step comes next: save after it
        else:
            self.save(trainer)

    def on_evaluate_end(self, trainer, results: dict[str, float]) -> None:
        self.metrics = {f"eval/{k}": v for k, v in results.items()}
        self.metrics_step = trainer.state.global_step
        if self._pending_step == trainer.state.global_step:
            self.save(trainer)

    def on_train_epoch_end(self, trainer) -> None:
        if _due(trainer.state.epoch, trainer.config.checkpoint.every_n_epochs):
            self.save(trainer)  # after the epoch's evaluation, at (next epoch, batch 0)

    def on_train_end(self, trainer) -> None:
        c = trainer.config.checkpoint
        scheduled = c.every_n_steps > 0 or c.every_n_epochs > 0
        if self.save_last and scheduled and self._saved_step != trainer.state.global_step:
            self.save(trainer)

    def on_save_checkpoint(self, trainer) -> Any:
        return {"metrics": self.metrics, "metrics_step": self.metrics_step}

    def on_load_checkpoint(self, trainer, saved: Any) -> None:
        self.metrics = dict(saved.get("metrics", {}))
        self.metrics_step = saved.get("metrics_step")

    def save(self, trainer) -> str:
        """Save `checkpoints/step-<N>` now (collective) and prune by the rules."""
        self._pending_step = None
        self._saved_step = trainer.state.global_step
        step = trainer.state.global_step
        path = str(trainer.folder.checkpoints / checkpoint_name(step))
        # only metrics measured on these very weights rank a checkpoint
        metrics = self.metrics if self.metrics_step == step else {}
        url = state.save_checkpoint(trainer, path, saved_by=SCHEDULE, metrics=metrics)
        if trainer.env.rank == 0:
            self.prune(trainer)
        return url

    def prune(self, trainer) -> list[str]:
        c = trainer.config.checkpoint
        collection = str(trainer.folder.checkpoints)
        doomed = to_delete(atomic.list_checkpoints(collection), c.keep_last, c.keep_best, c.monitor, c.mode)
        if doomed:
            atomic.flush_before_deleting(atomic.location(collection))
        for name in doomed:
            atomic.remove(atomic.location(collection).child(name))
        if doomed:
            trainer.emit({"type": "checkpoint_deleted", "step": trainer.state.global_step, "names": doomed})
        return doomed


class LoadBestModelCallback(Callback):
    """At the end of training, reload the weights of the best checkpoint by `monitor`."""

    def on_train_end(self, trainer) -> None:
        c = trainer.config.checkpoint
        best = best_checkpoint(atomic.list_checkpoints(str(trainer.folder.checkpoints)), c.monitor, c.mode)
        if best is None:
            trainer.emit({"type": "warning", "message": f"load_best_at_end: no checkpoint has a "
                          f"value of {c.monitor}; the final weights are kept"})
            return
        state.load_weights(trainer, best["url"])
        trainer.emit({"type": "best_model", "path": best["url"], "step": best["step"],
                      "monitor": c.monitor, "value": metric_of(best["metrics"], c.monitor)})


def checkpoint_callbacks(cfg: RunConfig) -> list[Callback]:
    """The callbacks a launched run gets: the schedule (always; it does nothing while no schedule
    is set) and, when asked, the best-model reload, which must come after it."""
    callbacks: list[Callback] = [CheckpointCallback()]
    if cfg.checkpoint.load_best_at_end:
        callbacks.append(LoadBestModelCallback())
    return callbacks
