"""The composition root: a run's parts, built once from its config, the same for every entry point.

A Trainer made in a script, in a notebook, or by the launched worker (`engine.worker`) is the
same run: its constructor hands what the user gave to `assemble`, stores the parts it gets back,
and lets `engine.assembly.loop.start` connect them. Each decision is made here, once:

    parse      the config (given)                                   -> RunConfig
    layout     the process groups (engine.assembly.process)         -> DistEnv, Layout object
    method     full / PEFT / fused                                  -> Method object
    data       tokenizer, datasets, step count (engine.assembly.data)
    engine     DeepSpeed config, model, deepspeed.initialize (engine.assembly.model) -> RunContext
    objective  SFT, a preference loss or GRPO: its reference model and the step strategy
    loop       callbacks, monitors, evaluators, checkpoint schedule, snapshots (engine.assembly.loop)

Nothing in engine.assembly imports the Trainer; the Trainer's constructor calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterable

from contract.config.checks import schema_problems
from contract.config.schema import ConfigError, RunConfig
from contract.deepspeed_config import DeepSpeedSetup
from contract.rewards import build_rewards
from engine.assembly.data import RunData, micro_batches_per_epoch, run_data, total_steps
from engine.assembly.loop import callbacks_of, evaluators_of, monitors_of, snapshots_of
from engine.assembly.model import check_model_config, ds_setup_of, engine_of, model_of, precision_of
from engine.assembly.process import init_distributed, open_run_folder
from engine.callbacks import Callback, CallbackList
from engine.checkpoint.schedule import CheckpointSchedule
from engine.checkpoint.snapshots import SnapshotStore
from engine.context import RunContext, TrainerState
from engine.model.methods import method_of
from engine.model.loading import tokenizer_of
from engine.monitors import Monitor
from engine.objectives.grpo_step import GrpoStep
from engine.objectives.preference import check_data, objective_of
from engine.parallel.layouts import layout_class
from engine.objectives.preference_step import (AdapterOffReference, copy_before_engine, disable_dropout, place_copy,
                                    step_for, zero3_reference)
from engine.rng import preserved_rng
from engine.steps import StepStrategy


@dataclass
class Given:
    """What a script hands the Trainer, in CoLLie's roles; what is None is built from the config."""
    model: Any = None
    tokenizer: Any = None
    loss_fn: Callable | None = None
    train_fn: Callable | None = None
    eval_fn: Callable | None = None
    optimizer: Any = None
    lr_scheduler: Any = None
    train_dataset: Any = None
    eval_dataset: Any = None
    train_collate_fn: Callable | None = None
    eval_collate_fn: Callable | None = None
    callbacks: tuple[Callback, ...] = ()
    monitors: Iterable[Monitor] | None = None
    evaluators: Iterable | None = None
    run_dir: str | None = None


@dataclass
class Assembled:
    """A run's parts, built: what a Trainer holds."""
    config: RunConfig
    ctx: RunContext
    data: RunData
    ds_setup: DeepSpeedSetup
    train_fn: Callable  # the step strategy (engine.steps), or the user's train_fn
    loss_fn: Callable | None
    eval_fn: Callable | None
    evaluators: list
    callbacks: CallbackList
    monitors: list[Monitor]
    checkpoints: CheckpointSchedule
    snapshots: SnapshotStore


def assemble(cfg: RunConfig, given: Given) -> Assembled:
    """Build a run's parts from its config; given parts (a user's model, tokenizer, datasets,
    optimizer ...) are used as they are. Every rank calls it (it joins the process group).
    The config is validated again first (ConfigError naming each field): one changed in code
    after loading (`cfg.optim.lr = -1`) is refused before anything is built."""
    problems = schema_problems(cfg)
    if problems:
        raise ConfigError(problems)
    ctx, data = _context(cfg, given)
    ds_setup, step = _engine_and_step(ctx, given)
    # a failed reward pauses the run; the samples event and the ratings (grpo_samples)
    step_hooks = (step, step.ratings) if isinstance(step, GrpoStep) else ()
    return Assembled(config=cfg, ctx=ctx, data=data, ds_setup=ds_setup, train_fn=given.train_fn or step,
                     loss_fn=given.loss_fn, eval_fn=given.eval_fn,
                     evaluators=evaluators_of(cfg, step, given.evaluators),
                     callbacks=callbacks_of(cfg, (*given.callbacks, *step_hooks)), monitors=monitors_of(given.monitors),
                     checkpoints=CheckpointSchedule(), snapshots=snapshots_of(cfg))


def _context(cfg: RunConfig, given: Given) -> tuple[RunContext, RunData]:
    """The layout and method objects, the run folder, the tokenizer, the data, the step count."""
    kind = layout_class(cfg.parallel)
    env = init_distributed(lambda rank, world: kind.groups(cfg.parallel, rank, world))
    layout, method = kind(env), method_of(cfg)
    folder, events = open_run_folder(cfg, given.run_dir, env.rank == 0)
    precision = precision_of(cfg)
    if given.model is None:
        check_model_config(cfg)  # before the tokenizer: an unknown architecture is named
    tokenizer = given.tokenizer or tokenizer_of(cfg)
    data = run_data(cfg, tokenizer, train_dataset=given.train_dataset, eval_dataset=given.eval_dataset,
                    train_collate_fn=given.train_collate_fn, eval_collate_fn=given.eval_collate_fn)
    check_data(cfg, data.reports)  # the objective and the rows' format agree (formats are known once read)
    ctx = RunContext(config=cfg, env=env, layout=layout, method=method, precision=precision,
                     tokenizer=tokenizer, folder=folder, events=events, state=TrainerState())
    ctx.state.total_steps = total_steps(cfg, micro_batches_per_epoch(ctx, data))
    return ctx, data


def _engine_and_step(ctx: RunContext, given: Given) -> tuple[DeepSpeedSetup, StepStrategy]:
    """The DeepSpeed config, the model (prepared by the method, then the layout), the engine
    (into `ctx`), the objective's reference and the step strategy."""
    cfg, env, layout, method, precision = ctx.config, ctx.env, ctx.layout, ctx.method, ctx.precision
    ds_setup = ds_setup_of(cfg, env, given.model, ctx.state.total_steps, precision)
    model = model_of(cfg, ds_setup, precision, given.model)
    objective = objective_of(cfg, env.dp_group, env.dp_size) or _grpo_needs(cfg)
    ref_copy = None
    if objective is not None:
        if given.loss_fn is not None:
            raise ValueError(f"preference.objective: {objective.name} computes its own loss; pass no loss_fn")
        disable_dropout(model)
        if objective.needs_reference and not method.has_adapter:
            ref_copy = copy_before_engine(model, cfg.parallel.zero_stage)
    model = method.prepare_model(model, cfg)
    whole = layout.whole_model_parameters(model)
    model = layout.prepare_model(model, cfg, given.loss_fn)
    if whole is not None:  # the parameter count of the whole model, before the split
        model.whole_model_parameters = whole
    method.adjust_ds_setup(ds_setup)
    ctx.engine, ctx.optimizer, ctx.lr_scheduler = engine_of(
        cfg, env, ds_setup, model, layout=layout, method=method, optimizer=given.optimizer,
        lr_scheduler=given.lr_scheduler, total_steps=ctx.state.total_steps)
    reference = _reference(cfg, objective, ctx, ds_setup, precision, ref_copy, given_model=given.model is not None)
    if cfg.preference.objective == "grpo":  # learning from rewards (engine.objectives.grpo_step)
        return ds_setup, GrpoStep(cfg.grpo, build_rewards(cfg.grpo.rewards, cfg.grpo.max_completion_length),
                                  reference)
    step = step_for(objective, method.step(layout), reference)
    return ds_setup, step


def _grpo_needs(cfg: RunConfig) -> SimpleNamespace | None:
    """What the assembly asks of a GRPO run's objective: its name and whether it compares with a
    reference (beta > 0: the KL term); None for the other objectives."""
    if cfg.preference.objective != "grpo":
        return None
    return SimpleNamespace(name="grpo", needs_reference=cfg.grpo.beta > 0)


def _reference(cfg: RunConfig, objective, ctx: RunContext, ds_setup: DeepSpeedSetup, precision: str,
               ref_copy, given_model: bool):
    """The reference the objective compares with (engine.objectives.preference_step): the policy without
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
            model = model_of(cfg, ds_setup, precision)
        disable_dropout(model)
        return model
    return zero3_reference(build, ds_setup.config)
