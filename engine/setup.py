"""Building a run's parts from its config: process group, run folder, data, model, engine.

Small builders the Trainer composes (torchtune style); only this module and `engine.ds_config`
talk to deepspeed directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from transformers import get_scheduler

from engine import data as data_layer
from engine import ds_config, lomo, methods, model as model_layer
from contract.config import RunConfig
from supervisor.launch import free_port, make_run_folder
from engine.monitors import open_sinks
from engine.parallel import tp as tensor_parallel
from engine.parallel.groups import build_layout
from engine.rng import seed_everything
from contract.run_folder import EventLog, RunFolder


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    dp_rank: int          # which data-parallel replica this rank is part of (its data shard)
    dp_size: int
    dp_group: object      # the ranks that hold the same layers on other data (None: the world)
    device: torch.device
    tp_size: int = 1      # tensor-parallel ranks per replica (engine.parallel.groups)
    tp_rank: int = 0
    pp_size: int = 1      # pipeline stages per replica
    stage: int = 0        # this rank's pipeline stage
    topology: object = None  # the pipeline's DeepSpeed ProcessTopology when pp_size > 1


def init_distributed(cfg: RunConfig | None = None) -> DistEnv:
    """Join the launcher's process group (gloo on CPU, nccl on GPU), or make a one-rank group
    when a script or notebook runs the Trainer without a launcher; then create the groups of
    the config's tp x pp x dp layout."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        _unlink_shm_buffers()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    p = cfg.parallel if cfg is not None else None
    layout = build_layout(p.tp_size if p else 1, p.pp_size if p else 1, rank, world)
    return DistEnv(rank, local_rank, world, dp_rank=layout.dp_rank, dp_size=layout.dp_size,
                   dp_group=layout.dp_group, device=device, tp_size=layout.tp_size,
                   tp_rank=layout.tp_rank, pp_size=layout.pp_size, stage=layout.stage,
                   topology=layout.topology)


def _unlink_shm_buffers() -> None:
    """DeepSpeed's CPU all-reduce maps a 66 MB /dev/shm file per rank and never deletes it.
    Once every rank has mapped them (the barrier), each rank unlinks its own, so the memory is
    freed when the processes exit, however they exit."""
    if torch.cuda.is_available() or dist.get_world_size() == 1:
        return
    dist.barrier()
    suffix = f"_{os.environ['MASTER_PORT']}_{dist.get_rank()}"
    for path in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"):
        if path.name.endswith(suffix):
            try:
                path.unlink()
            except OSError:
                pass


def open_run_folder(cfg: RunConfig, run_dir: str | None, is_rank0: bool) -> tuple[RunFolder, EventLog | None]:
    """The run folder (made by rank 0 when not given) and, on rank 0, its event log."""
    path = [run_dir]
    if run_dir is None:
        if is_rank0:
            path = [str(make_run_folder(cfg).root)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(path, src=0)
    folder = RunFolder(Path(path[0])).create()
    if not is_rank0:
        return folder, None
    if not folder.config.exists():
        folder.config.write_text(cfg.to_yaml())
    events, _ = open_sinks(folder.events, folder.tensorboard if cfg.logging.tensorboard else None)
    return folder, events


def precision_of(cfg: RunConfig) -> str:
    return ds_config.resolve_precision(cfg.train.precision)


def _default_assets():
    from engine import default_task
    return default_task.ensure_default_assets(default_task.default_root())


def model_dir_of(cfg: RunConfig) -> Path:
    return Path(cfg.model.path) if cfg.model.path else _default_assets().model_dir


def tokenizer_of(cfg: RunConfig):
    field = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    return model_layer.load_tokenizer(cfg.model.tokenizer or model_dir_of(cfg), field)


def datasets_of(cfg: RunConfig, tokenizer, train_dataset, eval_dataset):
    """Tokenized train / eval datasets and their reports; given datasets are used as they are."""
    reports = {}
    train_src, eval_src = cfg.data.train, cfg.data.eval
    if cfg.uses_default_task:
        assets = _default_assets()
        train_src, eval_src = str(assets.train_path), eval_src or str(assets.eval_path)
    if train_dataset is None:
        train_dataset, reports["train"] = data_layer.build_dataset(
            train_src, tokenizer, format=cfg.data.format, max_length=cfg.data.max_length,
            overlong=cfg.data.overlong)
    if eval_dataset is None and eval_src:
        eval_dataset, reports["eval"] = data_layer.build_dataset(
            eval_src, tokenizer, format=cfg.data.format, max_length=cfg.data.max_length,
            overlong=cfg.data.overlong)
    eval_rows = data_layer.load_rows(eval_src) if eval_src else None
    return train_dataset, eval_dataset, eval_rows, reports


def micro_batches_per_epoch(trainer) -> int:
    return trainer.train_loader(0).batch_sampler.num_batches


def train_loader_of(trainer, epoch: int, start_batch: int):
    cfg, env = trainer.config, trainer.env
    loader = data_layer.build_dataloader(
        trainer.train_dataset, micro_batch_size=cfg.train.micro_batch_size, dp_rank=env.dp_rank,
        dp_size=env.dp_size, seed=cfg.train.seed, strategy=cfg.data.batching,
        tokenizer=trainer.tokenizer, max_length=cfg.data.max_length,
        num_workers=cfg.data.num_workers, shuffle=True, drop_last=True,
        collate_fn=trainer.train_collate_fn)
    loader.batch_sampler.set_epoch(epoch)
    loader.batch_sampler.set_start_batch(start_batch)
    return loader


def eval_loader_of(trainer):
    cfg, env = trainer.config, trainer.env
    return data_layer.build_dataloader(
        trainer.eval_dataset, micro_batch_size=cfg.eval.batch_size, dp_rank=env.dp_rank,
        dp_size=env.dp_size, seed=cfg.train.seed, strategy="random", tokenizer=trainer.tokenizer,
        max_length=cfg.data.max_length, num_workers=0, shuffle=False, drop_last=False,
        collate_fn=trainer.eval_collate_fn)


def warmup_steps_of(cfg: RunConfig, total_steps: int) -> int:
    return cfg.optim.warmup_steps or int(cfg.optim.warmup_ratio * total_steps)


SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def engine_of(trainer, model, optimizer, lr_scheduler):
    """The DeepSpeed engine, with the model built (partitioned under ZeRO-3) when not given."""
    cfg, env = trainer.config, trainer.env
    folder = model_dir_of(cfg)
    total = trainer.state.total_steps
    warmup = warmup_steps_of(cfg, total)
    setup = ds_config.build_ds_config(
        cfg, world_size=env.world_size, dp_size=env.dp_size, total_steps=total, warmup_steps=warmup,
        hidden_size=model_layer.hidden_size(folder) if model is None else _model_hidden(model),
        precision=trainer.precision)
    seed_everything(cfg.train.seed)
    if model is None:
        model = model_layer.build_model(
            folder, seed=cfg.train.seed, precision=trainer.precision,
            attn_implementation=cfg.model.attn_implementation,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            init_context=lambda: ds_config.zero3_init(setup.config),
            trust_remote_code=cfg.model.trust_remote_code)
    model = methods.prepare_model(model, cfg)
    if env.tp_size > 1 or env.pp_size > 1:  # counted whole, before AutoTP shards or stages cut it
        whole = model_layer.count_parameters(model)
    if env.pp_size > 1:  # the same model, cut into this rank's pipeline stage
        from engine.parallel.pipeline import build_pipeline_module
        model = build_pipeline_module(model, topology=env.topology, partition=cfg.parallel.pp_partition,
                                      loss_fn=trainer.loss_fn)
    if env.tp_size > 1 or env.pp_size > 1:
        model.whole_model_parameters = whole
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = lomo.uses_fused_step(cfg)  # LOMO / AdaLomo: the fused step owns the update
    if fused:
        if optimizer is not None:
            raise ValueError(f"method.name: {cfg.method.name} updates inside backward; pass no optimizer")
        lomo.prepare_ds_setup(setup, cfg.method.name)
    if optimizer is None and not setup.ds_optimizer and trainable and not fused:
        optimizer = make_optimizer(model, cfg)
    if lr_scheduler is None and optimizer is not None and not setup.ds_scheduler:
        lr_scheduler = get_scheduler(SCHEDULERS[cfg.optim.scheduler], optimizer,
                                     num_warmup_steps=warmup, num_training_steps=max(total, 1))
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=setup.config,
        model_parameters=trainable if setup.ds_optimizer else None,
        mpu=tensor_parallel.engine_mpu(env.tp_size))
    if fused:  # built on the engine's module: under ZeRO-3 its parameters are the partitioned ones
        optimizer = lomo.build_optimizer(engine, cfg, setup.config, env.dp_group, env.dp_size)
        lr_scheduler = lr_scheduler or get_scheduler(
            SCHEDULERS[cfg.optim.scheduler], optimizer, num_warmup_steps=warmup,
            num_training_steps=max(total, 1))
    return engine, optimizer, lr_scheduler, setup


def make_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW / SGD over the trainable parameters; no weight decay on biases and norm weights."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # ZeRO-3 parameters are flat shards; their real shape is in ds_shape
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.optim.lr)
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)


def _model_hidden(model) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "hidden_size", None) if config is not None else None


def evaluators_of(cfg: RunConfig) -> list:
    from engine import evaluators
    return evaluators.from_config(cfg)


def parameter_counts(trainer) -> tuple[int, int]:
    return model_layer.count_parameters(trainer.engine.module)


def attach_server(trainer) -> None:
    """CoLLie's `server=True`: a small chat page on rank 0 fed through the control plane."""
    from engine.control import attach
    attach(trainer, chat_page=True)
