"""Building a run's parts from its config: process group, run folder, data, model, engine.

Small builders that `engine.assembly` composes (torchtune style); only this module and
`engine.ds_config` talk to deepspeed directly. The layout and method objects
(engine.parallel.layouts, engine.methods) are handed in: the builders ask them, never the config,
how the model is prepared and the DeepSpeed set-up adjusted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import deepspeed
import torch
import torch.distributed as dist
from transformers import get_scheduler

from contract import hub
from contract.config.schema import RunConfig
from contract.run_folder import EventLog, RunFolder, make_run_folder
from engine import data as data_layer
from engine import ds_config
from engine import model as model_layer
from engine import rendezvous
from engine.context import DistEnv
from contract.deepspeed_config import DeepSpeedSetup
from engine.monitors import open_sinks
from engine.parallel.groups import Groups, data_groups
from engine.rng import seed_everything
from contract import deepspeed_config


def init_distributed(make_groups: Callable[[int, int], Groups] = data_groups) -> DistEnv:
    """Join the launcher's process group (gloo on CPU, NCCL and gloo on GPUs: backend_for), or
    make a one-rank group when a script or notebook runs the Trainer without a launcher (this
    rank's GPU made current first: device_of); then create the groups of
    the run's layout: `make_groups(rank, world_size)` (the layout object's; plain data
    parallelism by default)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(rendezvous.free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    device = device_of(local_rank)
    if not dist.is_initialized():
        backend = backend_for(device.type == "cuda")
        _remove_stale_shm_buffer()
        rendezvous.join_on_loopback(backend)  # one machine: nothing listens beyond loopback
        deepspeed.init_distributed(dist_backend=backend)
        _unlink_shm_buffers()
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = make_groups(rank, world)
    return DistEnv(rank, local_rank, world, dp_rank=layout.dp_rank, dp_size=layout.dp_size,
                   dp_group=layout.dp_group, device=device, tp_size=layout.tp_size,
                   tp_rank=layout.tp_rank, pp_size=layout.pp_size, stage=layout.stage,
                   topology=layout.topology)


def device_of(local_rank: int) -> torch.device:
    """This rank's device: GPU `local_rank` of those visible, made current before the process
    group exists (NCCL binds its communicators to the current device); the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"parallel.nproc: local rank {local_rank} has no GPU of its own: {count} GPU"
                           f"{'s' * (count != 1)} visible (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {count} "
                           "ranks per machine")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def backend_for(cuda: bool) -> str:
    """The process group's backend: gloo on CPU; with GPUs, NCCL for CUDA tensors and gloo for
    CPU tensors. The loop's small collectives (a step's loss and token counts, evaluation sums,
    the guard's verdicts) reduce CPU tensors, which an NCCL-only group refuses ("no backend
    type associated with device type cpu") as soon as there are two ranks."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def _remove_stale_shm_buffer() -> None:
    """DeepSpeed's CPU all-reduce names each rank's /dev/shm buffer by user, MASTER_ADDR,
    MASTER_PORT and rank, and the other ranks map it as soon as the name exists. A run killed
    before `_unlink_shm_buffers` leaves its buffers behind; a later run on the same port would
    have its peers map the stale one before this rank rewrote it (a rank then crashed at start).
    Each rank removes its own name before the rendezvous, which no rank passes before all have
    joined, so no peer can have mapped it yet."""
    if torch.cuda.is_available():
        return
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
            f"{os.environ['MASTER_PORT']}_{os.environ['RANK']}")
    try:
        (Path("/dev/shm") / name).unlink()
    except OSError:
        pass


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
    return folder, open_sinks(folder.events, cfg)


def precision_of(cfg: RunConfig) -> str:
    return ds_config.resolve_precision(cfg.train.precision)


def _default_assets():
    from engine import default_task
    return default_task.ensure_default_assets(default_task.default_root())


def model_dir_of(cfg: RunConfig) -> Path:
    return hub.local_folder(cfg.model.path) if cfg.model.path else _default_assets().model_dir


def check_model_config(cfg: RunConfig) -> None:
    """Read the model folder's config first, so a bad config.json or an unknown architecture is
    named as such, not as a tokenizer that failed to load."""
    model_layer.read_config(model_dir_of(cfg), trust_remote_code=cfg.model.trust_remote_code)


def tokenizer_of(cfg: RunConfig):
    field = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    folder = hub.local_folder(cfg.model.tokenizer) if cfg.model.tokenizer else model_dir_of(cfg)
    return model_layer.load_tokenizer(folder, field)


def datasets_of(cfg: RunConfig, tokenizer, train_dataset, eval_dataset):
    """Tokenized train / eval datasets and their reports; given datasets are used as they are."""
    reports = {}
    train_src, eval_src = cfg.data.train, cfg.data.eval
    if cfg.uses_default_task:
        from engine.default_task import sources_for  # the objective's variant of the default task
        train_path, eval_path = sources_for(_default_assets(), cfg.preference.objective)
        train_src, eval_src = str(train_path), eval_src or str(eval_path)
    if train_dataset is None:
        train_dataset = training_sources(cfg, tokenizer, train_src, reports)
    if eval_dataset is None and eval_src:
        eval_dataset, reports["eval"] = data_layer.build_dataset(
            eval_src, tokenizer, format=cfg.data.format, max_length=cfg.data.max_length,
            overlong=cfg.data.overlong)
    eval_rows = data_layer.load_rows(eval_src) if eval_src else None
    return train_dataset, eval_dataset, eval_rows, reports


def training_sources(cfg: RunConfig, tokenizer, train_src: str, reports: dict):
    """The run's training sources (data.sources, or data.train as the one source "train") as a
    mixture (engine.data.mixture); each source's data report goes into `reports`."""
    from contract.config.checks import source_name
    from engine.data.mixture import MixtureDataset, Source, source_seed
    specs = cfg.data.sources or [{"path": train_src, "format": cfg.data.format, "name": "train"}]
    sources = []
    for i, spec in enumerate(specs):
        name = source_name(spec, i)
        dataset, report = data_layer.build_dataset(
            spec["path"], tokenizer, format=spec.get("format", "auto"), max_length=cfg.data.max_length,
            overlong=cfg.data.overlong)
        reports["train" if not cfg.data.sources else f"train/{name}"] = report
        sources.append(Source(name, dataset, path=spec["path"], format=spec.get("format", "auto"),
                              weight=float(spec.get("weight", 1.0)),
                              seed=source_seed(cfg.train.seed, name, first=i == 0)))
    return MixtureDataset(sources, build=lambda spec: rebuild_source(cfg, tokenizer, spec))


def rebuild_source(cfg: RunConfig, tokenizer, spec: dict):
    """The dataset of a source added live, from a checkpoint's record of it (at resume)."""
    if spec["kind"] == "inbox":
        from engine.data.inbox import InboxDataset
        return InboxDataset(tokenizer, cfg.data.max_length, spec["path"])
    return data_layer.build_dataset(spec["path"], tokenizer, format=spec["format"],
                                    max_length=cfg.data.max_length, overlong=cfg.data.overlong)[0]


def train_loader_of(cfg: RunConfig, env: DistEnv, dataset, tokenizer, collate_fn: Callable | None,
                    epoch: int, start_batch: int):
    """The training batches of `epoch` from micro-batch `start_batch` on, this rank's share."""
    loader = data_layer.build_dataloader(
        dataset, micro_batch_size=cfg.train.micro_batch_size, dp_rank=env.dp_rank,
        dp_size=env.dp_size, seed=cfg.train.seed, strategy=cfg.data.batching,
        tokenizer=tokenizer, max_length=cfg.data.max_length,
        num_workers=cfg.data.num_workers, shuffle=True, drop_last=True,
        collate_fn=collate_fn)
    loader.batch_sampler.set_epoch(epoch)
    loader.batch_sampler.set_start_batch(start_batch)
    return loader


def eval_loader_of(cfg: RunConfig, env: DistEnv, dataset, tokenizer, collate_fn: Callable | None):
    """The evaluation batches, this rank's share, in order."""
    return data_layer.build_dataloader(
        dataset, micro_batch_size=cfg.eval.batch_size, dp_rank=env.dp_rank,
        dp_size=env.dp_size, seed=cfg.train.seed, strategy="random", tokenizer=tokenizer,
        max_length=cfg.data.max_length, num_workers=0, shuffle=False, drop_last=False,
        collate_fn=collate_fn)


def warmup_steps_of(cfg: RunConfig, total_steps: int) -> int:
    return cfg.optim.warmup_steps or int(cfg.optim.warmup_ratio * total_steps)


SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def ds_setup_of(cfg: RunConfig, env: DistEnv, model, total_steps: int, precision: str) -> DeepSpeedSetup:
    """The run's DeepSpeed config (the run's method adjusts it once the model is prepared)."""
    return deepspeed_config.build_ds_config(
        cfg, world_size=env.world_size, dp_size=env.dp_size, total_steps=total_steps,
        warmup_steps=warmup_steps_of(cfg, total_steps),
        hidden_size=model_layer.hidden_size(model_dir_of(cfg)) if model is None else _model_hidden(model),
        precision=precision)


def model_of(cfg: RunConfig, setup: DeepSpeedSetup, precision: str, model=None):
    """The given model, or the config's built with the run's seed (partitioned under ZeRO-3)."""
    seed_everything(cfg.train.seed)
    if model is not None:
        return model
    return model_layer.build_model(
        model_dir_of(cfg), seed=cfg.train.seed, precision=precision,
        attn_implementation=cfg.model.attn_implementation,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        init_context=lambda: ds_config.zero3_init(setup.config),
        trust_remote_code=cfg.model.trust_remote_code)


def engine_of(cfg: RunConfig, env: DistEnv, setup: DeepSpeedSetup, model, *, layout, method,
              optimizer, lr_scheduler, total_steps: int):
    """deepspeed.initialize on the prepared model; returns (engine, optimizer, lr_scheduler).

    The optimizer and the schedule are the user's, DeepSpeed's (its config says so), ours
    (`make_optimizer`), or the method's own, built on the engine (LOMO / AdaLomo).
    """
    method.check_optimizer(optimizer)
    warmup = warmup_steps_of(cfg, total_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None and not setup.ds_optimizer and trainable and method.builds_optimizer:
        optimizer = make_optimizer(model, cfg)
    if lr_scheduler is None and optimizer is not None and not setup.ds_scheduler:
        lr_scheduler = get_scheduler(SCHEDULERS[cfg.optim.scheduler], optimizer,
                                     num_warmup_steps=warmup, num_training_steps=max(total_steps, 1))
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=setup.config,
        model_parameters=trainable if setup.ds_optimizer else None, mpu=layout.mpu())
    own = method.optimizer_after_engine(engine, cfg, setup, env)
    if own is not None:
        optimizer = own
        lr_scheduler = lr_scheduler or get_scheduler(
            SCHEDULERS[cfg.optim.scheduler], optimizer, num_warmup_steps=warmup,
            num_training_steps=max(total_steps, 1))
    return engine, optimizer, lr_scheduler


def make_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW / SGD over the trainable parameters; no weight decay on biases and norm weights."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # ZeRO-3 parameters are flat shards: the rule goes by their real shape
            (decay if len(ds_config.full_shape(p)) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.optim.lr)
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)


def _model_hidden(model) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "hidden_size", None) if config is not None else None
