"""The checkpoint schedule and the best-model reload: a phase of the training loop.

`CheckpointSchedule` saves a training checkpoint to the run's `checkpoints/step-<N>` every n
steps (the loop hands it the live value, so the control plane's `save_every_n_steps` takes
effect at once) and/or every n epochs and, when a schedule is on, once more at the end of
training. The loop calls it after the step's evaluation (engine.trainer), so a checkpoint of an
evaluated step carries that step's metrics. After each save the rules run on what is on disk:

- keep the newest `keep_last` scheduled checkpoints (0 keeps all),
- and the best `keep_best` by `monitor` (`mode` min or max), among the checkpoints evaluated at
  their own step (a checkpoint between evaluations has no metric and is not ranked),
- and always the newest one (`last`, the one `latest` names);

every other scheduled checkpoint is deleted -- except a checkpoint that a branch of the run
folder's tree starts from (contract.branches: the fork points are never deleted). Checkpoints saved by hand (the control plane's
`save`, `stop`) are never deleted by these rules. Because the rules read the markers on disk,
they hold across resumes without any state of their own.

A full disk (decided here): a scheduled save that does not fit first deletes the checkpoints the
rules would delete once it is written (never the newest complete one, never a hand-saved one) and
tries once more. If that frees nothing, or the disk is still too full, the run stops: every rank
raises the same DiskFullError, the worker records it as the run's failure (exit 1), and its
message names the folder, the space needed and free, and the newest complete checkpoint, which
`resume=latest` continues from exactly. Training on without the checkpoints the config asks for
would spend compute that a crash could not give back. Other save failures are an event and the
run goes on (the next scheduled save tries again).

With `checkpoint.load_best_at_end` the best checkpoint's weights are reloaded when training ends
(`load_best`, before the final model is exported), leaving the trainer's position as it is.

The schedule works on the Trainer (`trainer.save_checkpoint`, `trainer.folder` ...), like a
callback: it is part of the loop, above the checkpoint functions.
"""

from __future__ import annotations

import math
from typing import Any

from contract.branches import BranchTree
from contract.events import BestModelEvent, CheckpointDeletedEvent, WarningEvent
from engine.checkpoint import publish, state
from engine.checkpoint.agreement import Comm
from engine.checkpoint import locations
from engine.checkpoint import reading

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


def to_delete(checkpoints: list[dict], keep_last: int, keep_best: int, monitor: str, mode: str,
              protected: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """Names of the scheduled checkpoints the rules drop (see the module docstring).
    `checkpoints`: markers with "name", "step", "saved_by", "metrics" (and "url"); `protected`:
    URLs never dropped (the checkpoints branches start from)."""
    scheduled = sorted((c for c in checkpoints if c.get("saved_by") == SCHEDULE and c.get("url") not in protected),
                       key=lambda c: c["step"])
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


class CheckpointSchedule:
    """Saves on the run's schedule and applies keep-last / keep-best (module docstring)."""

    state_key = "CheckpointCallback"  # the name its state has in checkpoints (callbacks.pt)

    def __init__(self, save_last: bool = True):
        self.save_last = save_last
        self.metrics: dict[str, Any] = {}
        self.metrics_step: int | None = None  # the step `metrics` were measured at
        self._saved_step: int | None = None

    def note_evaluation(self, step: int, results: dict[str, float]) -> None:
        """The metrics of an evaluation at `step` (they rank a checkpoint of that very step)."""
        self.metrics = {f"eval/{k}": v for k, v in results.items()}
        self.metrics_step = step

    def after_step(self, trainer, every_n_steps: int) -> None:
        """Save when the step is due (`every_n_steps`: the live value, set may change it)."""
        if _due(trainer.state.global_step, every_n_steps):
            self.save(trainer)

    def after_epoch(self, trainer) -> None:
        if _due(trainer.state.epoch, trainer.config.checkpoint.every_n_epochs):
            self.save(trainer)  # after the epoch's evaluation, at (next epoch, batch 0)

    def at_end(self, trainer, every_n_steps: int) -> None:
        """The last scheduled save (when a schedule is on), then the best model's reload."""
        c = trainer.config.checkpoint
        scheduled = every_n_steps > 0 or c.every_n_epochs > 0
        if self.save_last and scheduled and self._saved_step != trainer.state.global_step:
            self.save(trainer)
        if c.load_best_at_end:
            load_best(trainer)

    def state_dict(self) -> dict:
        return {"metrics": self.metrics, "metrics_step": self.metrics_step}

    def load_state_dict(self, saved: Any) -> None:
        self.metrics = dict(saved.get("metrics", {}))
        self.metrics_step = saved.get("metrics_step")

    def save(self, trainer) -> str | None:
        """Save `checkpoints/step-<N>` now (collective) and prune by the rules. A failed save is
        an event (atomic.writing) and training goes on (None), except on a full disk: then the
        checkpoints the rules drop go first, and if that frees nothing the run ends with the
        DiskFullError, which names the folder, the space needed and free (module docstring)."""
        self._saved_step = step = trainer.state.global_step
        path = str(trainer.folder.checkpoints / checkpoint_name(step))
        # only metrics measured on these very weights rank a checkpoint
        metrics = self.metrics if self.metrics_step == step else {}
        try:
            url = trainer.save_checkpoint(path, saved_by=SCHEDULE, metrics=metrics)
        except locations.DiskFullError:
            # the rules would delete these once this save is done: delete them first and try once
            # more; when that frees nothing, the run ends with the disk-full message (raised)
            if not self.make_room(trainer, {"name": checkpoint_name(step), "step": step,
                                            "saved_by": SCHEDULE, "metrics": metrics}):
                raise
            url = trainer.save_checkpoint(path, saved_by=SCHEDULE, metrics=metrics)
        except locations.CheckpointError:
            return None  # any other failure: agreed by every rank, an event; training goes on
        if trainer.env.rank == 0:
            self.prune(trainer)
        return url

    def make_room(self, trainer, coming: dict) -> bool:
        """Delete the scheduled checkpoints the rules would delete once `coming` (a marker-like
        record of the checkpoint about to be saved) exists; collective. True when any went."""
        doomed: list[str] = []
        if trainer.env.rank == 0:
            c = trainer.config.checkpoint
            collection = locations.location(str(trainer.folder.checkpoints))
            present = reading.list_checkpoints(collection.url)
            doomed = [n for n in to_delete([*present, coming], c.keep_last, c.keep_best, c.monitor, c.mode,
                                           fork_points(trainer)) if n != coming["name"]]
            for name in doomed:
                publish.remove(collection.child(name))
            if doomed:
                trainer.emit(CheckpointDeletedEvent(
                    step=trainer.state.global_step, names=doomed,
                    reason="disk full: deleted before the save, as the keep rules would after it"))
        return bool(Comm.current().broadcast(bool(doomed)))

    def prune(self, trainer) -> list[str]:
        c = trainer.config.checkpoint
        collection = str(trainer.folder.checkpoints)
        doomed = to_delete(reading.list_checkpoints(collection), c.keep_last, c.keep_best, c.monitor, c.mode,
                           fork_points(trainer))
        if doomed:
            publish.flush_before_deleting(locations.location(collection))
        for name in doomed:
            publish.remove(locations.location(collection).child(name))
        if doomed:
            trainer.emit(CheckpointDeletedEvent(step=trainer.state.global_step, names=doomed))
        return doomed


def fork_points(trainer) -> set[str]:
    """The checkpoint URLs the run folder's branches start from (never deleted)."""
    return {locations.location(u).url for u in BranchTree.load(trainer.folder.root).fork_sources()}


def load_best(trainer) -> None:
    """Reload the weights of the run's best checkpoint by `checkpoint.monitor` (collective)."""
    c = trainer.config.checkpoint
    best = best_checkpoint(reading.list_checkpoints(str(trainer.folder.checkpoints)), c.monitor, c.mode)
    if best is None:
        trainer.emit(WarningEvent(message=f"load_best_at_end: no checkpoint has a "
                                  f"value of {c.monitor}; the final weights are kept"))
        return
    state.load_weights(trainer, best["url"])
    trainer.emit(BestModelEvent(path=best["url"], step=best["step"], monitor=c.monitor,
                                value=metric_of(best["metrics"], c.monitor)))
