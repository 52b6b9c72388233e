"""The loop's parts and how a built Trainer is connected to them.

Built before the Trainer (engine.assembly.root calls these): the callbacks (the user's, then
those the config asks for: early stopping, the spike guard), the monitors, the evaluators, the
snapshots kept in host memory. Connected once the Trainer holds its parts, by its constructor,
in this order: `announce_run` (the callbacks' set-up hooks, the setup event), `control_of` (the
control plane, which drives the trainer, so it needs one; the Trainer declares what it returns),
`start` (the callbacks' initialized hook, the resume).
"""

from __future__ import annotations

from typing import Iterable

from contract.config.schema import RunConfig
from contract.deepspeed_config import DeepSpeedSetup
from contract.events import SetupEvent
from engine.evaluation import evaluators as evaluator_layer
from engine.assembly.data import RunData
from engine.callbacks import Callback, CallbackList
from engine.checkpoint import resolve_resume
from engine.checkpoint import rewind
from engine.checkpoint.snapshots import SnapshotStore
from engine.context import RunContext
from engine.control.plane import Control
from engine.evaluation.early_stopping import EarlyStopping
from engine.guard.hook import GuardCallback
from engine.model.loading import count_parameters
from engine.monitors import DEFAULT_MONITORS, Monitor
from engine.objectives.preference_step import evaluators_for
from engine.steps import StepStrategy


def callbacks_of(cfg: RunConfig, given: Iterable[Callback]) -> CallbackList:
    """The user's callbacks, then those the config itself asks for: early stopping, the spike
    guard (engine.guard.hook)."""
    stopping = EarlyStopping.from_config(cfg)
    return CallbackList([*given, *(c for c in (stopping, GuardCallback.from_config(cfg)) if c is not None)])


def monitors_of(given: Iterable[Monitor] | None) -> list[Monitor]:
    """The user's monitors, or the default set (engine.monitors)."""
    return list(given) if given is not None else [m() for m in DEFAULT_MONITORS]


def evaluators_of(cfg: RunConfig, step: StepStrategy, given: Iterable | None) -> list:
    """The user's evaluators, or those `eval.evaluators` names (with the preference metrics
    where the step strategy is a preference objective's)."""
    if given is not None:
        return list(given)
    return evaluators_for(step, evaluator_layer.from_config(cfg), cfg.eval.max_samples)


def snapshots_of(cfg: RunConfig) -> SnapshotStore:
    """The store of in-memory snapshots (checkpoint.snapshots_keep, snapshots_max_mib)."""
    return SnapshotStore(cfg.checkpoint.snapshots_keep, cfg.checkpoint.snapshots_max_mib)


def announce_run(trainer) -> None:
    """The callbacks' set-up hook, then the setup event. Collective."""
    trainer.callbacks.fire("on_setup_parallel_model", trainer)
    announce(trainer.ctx, trainer.data, trainer.ds_setup)


def control_of(trainer, chat_page: bool) -> Control | None:
    """The run's control plane (rank 0's server, every rank's boundary) when the config enables
    it, or `Trainer(server=True)` asks for the chat page; None otherwise. Collective."""
    if trainer.config.control.enabled or chat_page:
        return Control(trainer, chat_page=chat_page)
    return None


def start(trainer) -> None:
    """The callbacks' initialized hook, then the resume point. Collective."""
    trainer.callbacks.fire("on_after_trainer_initialized", trainer)
    resume = resume_point(trainer.ctx)
    if resume is not None:
        trainer.load_checkpoint(resume)


def announce(ctx: RunContext, data: RunData, ds_setup: DeepSpeedSetup) -> None:
    """The setup event: the layout's sizes, the precision, the step count, the parameter and
    sample counts, the data reports, DeepSpeed's warnings."""
    total, trainable = count_parameters(ctx.engine.module)
    lora_targets = ctx.method.lora_targets
    ctx.emit(SetupEvent(world_size=ctx.env.world_size, dp_size=ctx.env.dp_size,
                        precision=ctx.precision, total_steps=ctx.state.total_steps,
                        parameters=total, trainable_parameters=trainable,
                        train_samples=len(data.train),
                        eval_samples=len(data.eval) if data.eval is not None else 0,
                        data={k: r.summary() for k, r in data.reports.items()},
                        warnings=ds_setup.warnings, loss_average=ctx.config.train.loss_average,
                        **({"lora_targets": lora_targets} if lora_targets else {})))


def resume_point(ctx: RunContext) -> str | None:
    """The training checkpoint `resume=` names (None when the run starts afresh); a branch's
    name (or `latest` in a run that has branched) continues that branch, in its own folder."""
    if not ctx.config.resume:
        return None
    return resolve_resume(rewind.enter_resumed_branch(ctx), ctx.folder)
