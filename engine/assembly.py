"""The composition root: a run's parts, built once from its config, the same for every entry point.

`Trainer(config=...)` calls these builders in its constructor, so a Trainer made in a script, in
a notebook, or by the launched worker (`engine.worker`) is the same run: the same layout and
method objects, the checkpoint schedule, the control plane when `control.enabled`, `resume`, and
(in `Trainer.train`) the final save. Each decision is made here, once:

    parse     the config (given)                        -> RunConfig
    layout    the process groups                        -> DistEnv, Layout object
    method    full / PEFT / fused                       -> Method object
    data      tokenizer, datasets, loaders, step count
    engine    DeepSpeed config, model, deepspeed.initialize -> RunContext
    loop      step strategy, evaluators, checkpoint schedule, control plane, resume point,
              the callbacks the config asks for (early stopping)

Nothing here imports the Trainer; the Trainer imports this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from contract.config.schema import RunConfig
from engine import evaluators as evaluator_layer
from engine import setup
from engine.checkpoint import CheckpointSchedule, resolve_resume
from engine.checkpoint import rewind
from engine.context import RunContext, TrainerState
from engine.control import Control
from contract.deepspeed_config import DeepSpeedSetup
from engine.early_stopping import EarlyStopping
from engine.guard_hook import GuardCallback
from engine.methods import method_of
from engine.model import count_parameters
from engine.objectives import check_data, objective_of
from engine.parallel.layouts import layout_class
from engine.rng import preserved_rng
from engine.preference_step import (AdapterOffReference, copy_before_engine, disable_dropout, evaluators_for,
                                    place_copy, step_for, zero3_reference)
from engine.steps import StepStrategy


@dataclass
class Data:
    """The run's data: tokenized datasets, the raw evaluation rows (for evaluators that generate
    and compare text), the data reports, and the collate functions given."""
    train: Any
    eval: Any
    eval_rows: list | None
    reports: dict
    train_collate_fn: Callable | None = None
    eval_collate_fn: Callable | None = None


@dataclass
class Assembled:
    """What `assemble` builds: the run context and the loop's parts."""
    ctx: RunContext
    data: Data
    ds_setup: DeepSpeedSetup
    step: StepStrategy
    checkpoints: CheckpointSchedule
    evaluators: list = field(default_factory=list)


def assemble(cfg: RunConfig, *, model=None, tokenizer=None, loss_fn: Callable | None = None,
             optimizer=None, lr_scheduler=None, train_dataset=None, eval_dataset=None,
             train_collate_fn: Callable | None = None, eval_collate_fn: Callable | None = None,
             evaluators=None, run_dir: str | None = None) -> Assembled:
    """Build a run's parts from its config; given parts (a user's model, tokenizer, datasets,
    optimizer ...) are used as they are. Every rank calls it (it joins the process group)."""
    model_given = model is not None
    kind = layout_class(cfg.parallel)
    env = setup.init_distributed(lambda rank, world: kind.groups(cfg.parallel, rank, world))
    layout, method = kind(env), method_of(cfg)
    folder, events = setup.open_run_folder(cfg, run_dir, env.rank == 0)
    precision = setup.precision_of(cfg)
    if model is None:
        setup.check_model_config(cfg)  # before the tokenizer: an unknown architecture is named
    tokenizer = tokenizer or setup.tokenizer_of(cfg)
    train, evaluation, eval_rows, reports = setup.datasets_of(cfg, tokenizer, train_dataset, eval_dataset)
    check_data(cfg, reports)  # the objective and the rows' format agree (formats are known once read)
    data = Data(train, evaluation, eval_rows, reports, train_collate_fn, eval_collate_fn)
    state = TrainerState()
    ctx = RunContext(config=cfg, env=env, layout=layout, method=method, precision=precision,
                     tokenizer=tokenizer, folder=folder, events=events, state=state)
    state.total_steps = total_steps(cfg, micro_batches_per_epoch(ctx, data))
    ds_setup = setup.ds_setup_of(cfg, env, model, state.total_steps, precision)
    model = setup.model_of(cfg, ds_setup, precision, model)
    objective = objective_of(cfg, env.dp_group, env.dp_size)
    ref_copy = None
    if objective is not None:
        if loss_fn is not None:
            raise ValueError(f"preference.objective: {objective.name} computes its own loss; pass no loss_fn")
        disable_dropout(model)
        if objective.needs_reference and not method.has_adapter:
            ref_copy = copy_before_engine(model, cfg.parallel.zero_stage)
    model = method.prepare_model(model, cfg)
    whole = layout.whole_model_parameters(model)
    model = layout.prepare_model(model, cfg, loss_fn)
    if whole is not None:  # the parameter count of the whole model, before the split
        model.whole_model_parameters = whole
    method.adjust_ds_setup(ds_setup)
    ctx.engine, ctx.optimizer, ctx.lr_scheduler = setup.engine_of(
        cfg, env, ds_setup, model, layout=layout, method=method, optimizer=optimizer,
        lr_scheduler=lr_scheduler, total_steps=state.total_steps)
    reference = _reference(cfg, objective, ctx, ds_setup, precision, ref_copy, given_model=model_given)
    step = step_for(objective, method.step(layout), reference)
    return Assembled(ctx=ctx, data=data, ds_setup=ds_setup, step=step, checkpoints=CheckpointSchedule(),
                     evaluators=list(evaluators) if evaluators is not None else evaluators_for(
                         step, evaluator_layer.from_config(cfg), cfg.eval.max_samples))


def _reference(cfg: RunConfig, objective, ctx: RunContext, ds_setup: DeepSpeedSetup, precision: str,
               ref_copy, given_model: bool):
    """The reference the objective compares with (engine.preference_step): the policy without
    its adapter (PEFT), the frozen copy (full, ZeRO 0-2, tensor parallel), a partitioned copy
    built like the policy (full, ZeRO-3); None when the objective needs none."""
    if objective is None or not objective.needs_reference:
        return None
    if ctx.method.has_adapter:
        return AdapterOffReference(ctx)
    if ref_copy is not None:
        return place_copy(ref_copy, ctx.engine)
    if given_model:
        raise ValueError(f"preference.objective: {objective.name} under ZeRO-3 builds its frozen reference "
                         "from the config (model.path), but a model object was given; give none, or use "
                         "a PEFT method (the reference is then the model without its adapter)")

    def build():
        with preserved_rng():  # building re-seeds: the training's random state must not move
            model = setup.model_of(cfg, ds_setup, precision)
        disable_dropout(model)
        return model
    return zero3_reference(build, ds_setup.config)


def train_loader(ctx: RunContext, data: Data, epoch: int, start_batch: int = 0):
    """The training batches of `epoch`, this rank's share, from micro-batch `start_batch` on."""
    return setup.train_loader_of(ctx.config, ctx.env, data.train, ctx.tokenizer, data.train_collate_fn,
                                 epoch, start_batch)


def eval_loader(ctx: RunContext, data: Data):
    return setup.eval_loader_of(ctx.config, ctx.env, data.eval, ctx.tokenizer, data.eval_collate_fn)


def micro_batches_per_epoch(ctx: RunContext, data: Data) -> int:
    return train_loader(ctx, data, 0).batch_sampler.num_batches


def total_steps(cfg: RunConfig, micro_batches: int) -> int:
    """Optimizer steps of the run: train.max_steps, or every epoch's."""
    return cfg.train.max_steps or (micro_batches // cfg.train.grad_accum) * cfg.train.epochs


def epochs(cfg: RunConfig, micro_batches: int) -> int:
    """Epochs the loop runs: enough to reach train.max_steps, or train.epochs."""
    if cfg.train.max_steps:
        return math.ceil(cfg.train.max_steps / max(1, micro_batches // cfg.train.grad_accum))
    return cfg.train.epochs


def config_callbacks(cfg: RunConfig) -> list:
    """The callbacks the config itself asks for (after the user's own): early stopping, the
    spike guard (engine.guard_hook)."""
    stopping = EarlyStopping.from_config(cfg)
    return [c for c in (stopping, GuardCallback.from_config(cfg)) if c is not None]


def control_plane(trainer, chat_page: bool) -> Control | None:
    """The control plane of a built trainer when the config enables it (or `Trainer(server=True)`
    asks for the chat page): rank 0's server, every rank's step boundary. Collective."""
    if not (trainer.config.control.enabled or chat_page):
        return None
    return Control(trainer, chat_page=chat_page)


def resume_point(ctx: RunContext) -> str | None:
    """The training checkpoint `resume=` names (None when the run starts afresh); a branch's
    name (or `latest` in a run that has branched) continues that branch, in its own folder."""
    if not ctx.config.resume:
        return None
    return resolve_resume(rewind.enter_resumed_branch(ctx), ctx.folder)


def parameter_counts(ctx: RunContext) -> tuple[int, int]:
    return count_parameters(ctx.engine.module)
