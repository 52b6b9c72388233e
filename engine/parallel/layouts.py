"""The parallel layout of a run, one object chosen once at assembly: data-parallel (ZeRO 0-3),
tensor-parallel (DeepSpeed AutoTP) or pipeline (a DeepSpeed PipelineModule).

A layout carries every operation in which layouts differ, so no code elsewhere asks
`pp_size > 1` or `tp_size > 1`:

    groups(parallel, rank, world)        the process groups (a static method: before the instance)
    prepare_model(model, cfg, loss_fn)   the model the engine is built on (pipeline: cut in stages)
    mpu()                                the model-parallel unit deepspeed.initialize gets
    step()                               the step strategy (engine step, pipeline schedule)
    compute_loss(run, batch, forward, loss_fn, window)   the loss of one batch (pipeline: stage to stage)
    generate(run, prompts, **options)    generation with the live weights (collective)
    logit_summary(run, inputs, summarize, shape)   token log-probabilities (engine.generation.scoring; collective)
    full_state_dict(run)                 whole-model weights, Hugging Face names, on rank 0
    load_full_state_dict(run, state)     whole-model weights into this rank's share
    save_model(run, path, max_shard_size) / load_model(run, path)   Hugging Face folders
    checkpoint_client_state()            what DeepSpeed's universal checkpoint asks of the client
    whole_model_parameters(model)        the parameter count of the whole model, before a split

`run` is the run's `engine.context.RunContext` (a Trainer has the same attributes). The module-
level `full_state_dict`, `load_full_state_dict`, `shape_problems` and `hf_config_of` are kept
for scripts and tests: they call the run's layout.
"""

from __future__ import annotations

import shutil
from typing import Any, Callable

import torch
from torch import nn

from contract.config.schema import ParallelConfig, RunConfig
from engine.parallel import ds_config
from engine.checkpoint import models
from engine.checkpoint.agreement import Comm
from engine.context import DistEnv, RunContext
from engine.generation.generate import hf_generate
from engine.objectives.losses import PER_MICRO_BATCH, Window, model_loss
from engine.model.loading import count_parameters
from contract import capabilities
from engine.parallel import groups as process_groups
from engine.parallel import pipeline, tp, weights
from engine.generation.pipeline import pipeline_generate
from engine.generation.scoring import Summarize, forward_summary, pipeline_summary
from engine.steps import EngineStep, StepStrategy


class DataParallel:
    """Every rank holds the whole model (ZeRO 1-3 partition its states, and under stage 3 its
    weights, which DeepSpeed gathers layer by layer)."""
    name, split = "data-parallel", False
    kind = capabilities.Layout.DATA  # its row in the capability table (contract.capabilities)

    @staticmethod
    def groups(parallel: ParallelConfig, rank: int, world_size: int) -> process_groups.Groups:
        return process_groups.data_groups(rank, world_size)

    def __init__(self, env: DistEnv):
        self.env = env

    def prepare_model(self, model: nn.Module, cfg: RunConfig, loss_fn: Callable | None) -> nn.Module:
        return model

    def mpu(self) -> Any:
        return None

    def step(self) -> StepStrategy:
        return EngineStep()

    def compute_loss(self, run: RunContext, batch: dict, forward: Callable, loss_fn: Callable | None,
                     window: Window = PER_MICRO_BATCH) -> torch.Tensor:
        return model_loss(forward, batch, run.engine.device, loss_fn, window, module=run.engine.module,
                          at_labels=run.config.train.logits_at_labels,
                          chunk_rows=run.config.train.logits_chunk_rows)

    def generate(self, run: RunContext, prompts: list[str], **options) -> list[str]:
        return hf_generate(run, prompts, **options)

    def logit_summary(self, run: RunContext, inputs: dict, summarize: Summarize, shape: tuple) -> torch.Tensor:
        return forward_summary(run, inputs, summarize)  # engine.generation.scoring

    def full_state_dict(self, run: RunContext) -> dict[str, torch.Tensor] | None:
        if self.env.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in run.engine.module.state_dict().items()}

    def load_full_state_dict(self, run: RunContext, state_dict: dict[str, torch.Tensor]) -> None:
        module = run.engine.module
        result = module.load_state_dict(state_dict, strict=False)
        weights.raise_if_missing(weights.untied_missing(module, result.missing_keys, state_dict))
        ds_config.refresh_master_weights(run.engine)

    def save_model(self, run: RunContext, path: str, max_shard_size: int | str) -> dict:
        module = run.engine.module
        return models.save_hf(run, path, module, models.model_entries(module), max_shard_size)

    def load_model(self, run: RunContext, path: str) -> None:
        module = run.engine.module
        models.load_tensors(run, path, dict(models.named_tensors(module)), models.tensor_aliases(module))

    def checkpoint_client_state(self) -> dict:
        # with plain data parallelism no tensor needs merge patterns, only the format version
        return ds_config.universal_checkpoint_info()

    def whole_model_parameters(self, model: nn.Module) -> int | None:
        return None


class _Split:
    """What the tensor-parallel and pipeline layouts share: the whole model is gathered to rank
    0 to be saved, and a folder is checked against the whole model before every rank reads it
    and keeps its own part."""
    split = True
    env: DistEnv

    def whole_model_parameters(self, model: nn.Module) -> int | None:
        return count_parameters(model)  # counted whole, before AutoTP shards or stages cut it

    def save_model(self, run: RunContext, path: str, max_shard_size: int | str) -> dict:
        state = self.full_state_dict(run) or {}  # type: ignore[attr-defined]
        entries = [models.Entry(k, [], (lambda v=v: v), tuple(v.shape), v.dtype) for k, v in state.items()]
        return models.save_hf(run, path, weights.model_files_source(run.engine.module), entries, max_shard_size)

    def load_model(self, run: RunContext, path: str) -> None:
        comm = Comm.current()
        local, temporary = models.fetch_model_folder(path, comm)
        try:
            models.verify_if_marked(local, str(path), comm)
            reader = models.WeightReader(local)
            problems = weights.shape_problems(weights.hf_config_of(run.engine.module),
                                              {k: reader.shape(k) for k in reader.keys()})
            if problems:
                raise models.ModelLoadError(f"the weights in {path} do not fit this model "
                                            f"({'; '.join(problems)}); nothing was loaded")
            self.load_full_state_dict(run, {k: reader.get(k) for k in reader.keys()})  # type: ignore[attr-defined]
        finally:
            if temporary:
                shutil.rmtree(local, ignore_errors=True)

    def checkpoint_client_state(self) -> dict:
        return {}  # DeepSpeed records its own (AutoTP), or has none to give (pipeline)


class TensorParallel(_Split):
    """DeepSpeed AutoTP: each tensor group shares a sharded model (engine.parallel.tp)."""
    name = "tensor-parallel"
    kind = capabilities.Layout.TENSOR

    @staticmethod
    def groups(parallel: ParallelConfig, rank: int, world_size: int) -> process_groups.Groups:
        return process_groups.tensor_groups(parallel.tp_size, world_size)

    def __init__(self, env: DistEnv):
        self.env = env

    def prepare_model(self, model: nn.Module, cfg: RunConfig, loss_fn: Callable | None) -> nn.Module:
        return model  # AutoTP shards it inside deepspeed.initialize (the DeepSpeed config says so)

    def mpu(self) -> Any:
        return tp.engine_mpu(self.env.tp_size)

    def step(self) -> StepStrategy:
        return EngineStep()

    def compute_loss(self, run: RunContext, batch: dict, forward: Callable, loss_fn: Callable | None,
                     window: Window = PER_MICRO_BATCH) -> torch.Tensor:
        return model_loss(forward, batch, run.engine.device, loss_fn, window, module=run.engine.module,
                          at_labels=run.config.train.logits_at_labels,
                          chunk_rows=run.config.train.logits_chunk_rows)

    def generate(self, run: RunContext, prompts: list[str], **options) -> list[str]:
        return hf_generate(run, prompts, **options)

    def logit_summary(self, run: RunContext, inputs: dict, summarize: Summarize, shape: tuple) -> torch.Tensor:
        return forward_summary(run, inputs, summarize)  # engine.generation.scoring

    def full_state_dict(self, run: RunContext) -> dict[str, torch.Tensor] | None:
        engine = run.engine
        state = tp.full_state_dict(engine)
        # DeepSpeed's consolidation lists a tied weight under both names; keep the first, as
        # save_pretrained does
        aliases = weights.tied_aliases(engine.module)
        return None if state is None else {k: v for k, v in state.items() if k not in aliases}

    def load_full_state_dict(self, run: RunContext, state_dict: dict[str, torch.Tensor]) -> None:
        weights.raise_if_missing(tp.load_full_state_dict(run.engine.module, state_dict))
        ds_config.refresh_master_weights(run.engine)


class Pipeline(_Split):
    """A DeepSpeed PipelineModule: each rank runs one stage of the layers (engine.parallel.pipeline)."""
    name = "pipeline"
    kind = capabilities.Layout.PIPELINE

    @staticmethod
    def groups(parallel: ParallelConfig, rank: int, world_size: int) -> process_groups.Groups:
        return process_groups.pipeline_groups(parallel.pp_size, rank, world_size)

    def __init__(self, env: DistEnv):
        self.env = env

    def prepare_model(self, model: nn.Module, cfg: RunConfig, loss_fn: Callable | None) -> nn.Module:
        return pipeline.build_pipeline_module(model, topology=self.env.topology,
                                              partition=cfg.parallel.pp_partition, loss_fn=loss_fn)

    def mpu(self) -> Any:
        return None

    def step(self) -> StepStrategy:
        return pipeline.PipelineStep()

    def compute_loss(self, run: RunContext, batch: dict, forward: Callable, loss_fn: Callable | None,
                     window: Window = PER_MICRO_BATCH) -> torch.Tensor:
        # the stages hold different layers: the batch goes from stage to stage (evaluation only;
        # training weighs its micro-batches in the schedule's loss, pipeline.PipelineStep)
        return pipeline.eval_loss(run.engine, batch, run.config.train.logits_at_labels,
                                  run.config.train.logits_chunk_rows)

    def generate(self, run: RunContext, prompts: list[str], **options) -> list[str]:
        return pipeline_generate(run, prompts, **options)

    def logit_summary(self, run: RunContext, inputs: dict, summarize: Summarize, shape: tuple) -> torch.Tensor:
        return pipeline_summary(run, inputs, summarize, shape)  # engine.generation.scoring

    def full_state_dict(self, run: RunContext) -> dict[str, torch.Tensor] | None:
        return weights.gather_stages(run.engine.module, self.env)

    def load_full_state_dict(self, run: RunContext, state_dict: dict[str, torch.Tensor]) -> None:
        weights.raise_if_missing(run.engine.module.load_hf_state_dict(state_dict))
        ds_config.refresh_master_weights(run.engine)


LayoutClass = type[DataParallel] | type[TensorParallel] | type[Pipeline]


def layout_class(parallel: ParallelConfig) -> LayoutClass:
    """The run's layout (the one place that asks tp_size and pp_size): its class makes the
    process groups (`groups`), an instance on the resulting DistEnv does the rest."""
    if parallel.tp_size > 1 and parallel.pp_size > 1:
        raise ValueError("parallel.pp_size: tensor and pipeline parallelism cannot be combined")
    if parallel.pp_size > 1:
        return Pipeline
    if parallel.tp_size > 1:
        return TensorParallel
    return DataParallel


# -- for scripts and tests: the run's layout does the work ---------------------------------------

def full_state_dict(run: RunContext) -> dict[str, torch.Tensor] | None:
    """The whole model's weights under their Hugging Face names on global rank 0, None on the
    other ranks (collective)."""
    return run.layout.full_state_dict(run)


def load_full_state_dict(run: RunContext, state_dict: dict[str, torch.Tensor]) -> None:
    """Put whole-model weights (every rank passes the same) into the engine's layout; raises
    ValueError naming the weights the model needs and did not get."""
    run.layout.load_full_state_dict(run, state_dict)


def hf_config_of(run: RunContext):
    return weights.hf_config_of(run.engine.module)


def shape_problems(run: RunContext, file_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    return weights.shape_problems(hf_config_of(run), file_shapes)


__all__ = [ "DataParallel", "TensorParallel", "Pipeline", "layout_class", "full_state_dict",
           "load_full_state_dict", "hf_config_of", "shape_problems"]
