"""The model and its DeepSpeed engine: the precision, the DeepSpeed config, the model (given,
or built from the config with the run's seed, partitioned under ZeRO-3), the optimizer and the
schedule, `deepspeed.initialize`. Only this module and `engine.parallel.ds_config` talk to deepspeed
directly. The layout and method objects (engine.parallel.layouts, engine.model.methods) are handed in:
these builders ask them, never the config, how the DeepSpeed set-up is adjusted."""

from __future__ import annotations

import deepspeed
import torch

from contract import deepspeed_config
from contract.config.schema import RunConfig
from contract.deepspeed_config import DeepSpeedSetup
from engine.assembly.schedule import lr_schedule
from engine.parallel import ds_config
from engine.context import DistEnv
from engine.model.loading import build_model, hidden_size, model_dir_of, quantization_config, read_config
from engine.rng import seed_everything


def precision_of(cfg: RunConfig) -> str:
    return ds_config.resolve_precision(cfg.train.precision)


def check_model_config(cfg: RunConfig) -> None:
    """Read the model folder's config first, so a bad config.json or an unknown architecture is
    named as such, not as a tokenizer that failed to load."""
    read_config(model_dir_of(cfg), trust_remote_code=cfg.model.trust_remote_code)


def warmup_steps_of(cfg: RunConfig, total_steps: int) -> int:
    return cfg.optim.warmup_steps or int(cfg.optim.warmup_ratio * total_steps)


def ds_setup_of(cfg: RunConfig, env: DistEnv, model, total_steps: int, precision: str) -> DeepSpeedSetup:
    """The run's DeepSpeed config (the run's method adjusts it once the model is prepared)."""
    return deepspeed_config.build_ds_config(
        cfg, world_size=env.world_size, dp_size=env.dp_size, total_steps=total_steps,
        warmup_steps=warmup_steps_of(cfg, total_steps),
        hidden_size=hidden_size(model_dir_of(cfg)) if model is None else _model_hidden(model),
        precision=precision)


def model_of(cfg: RunConfig, setup: DeepSpeedSetup, precision: str, model=None):
    """The given model, or the config's built with the run's seed (partitioned under ZeRO-3)."""
    seed_everything(cfg.train.seed)
    if model is not None:
        return model
    return build_model(
        model_dir_of(cfg), seed=cfg.train.seed, precision=precision,
        attn_implementation=cfg.model.attn_implementation,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        init_context=lambda: ds_config.zero3_init(setup.config),
        trust_remote_code=cfg.model.trust_remote_code,
        quantization=quantization_config(cfg.model, precision))


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
        lr_scheduler = lr_schedule(cfg.optim.scheduler, optimizer, warmup, max(total_steps, 1))
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=setup.config,
        model_parameters=trainable if setup.ds_optimizer else None, mpu=layout.mpu())
    own = method.optimizer_after_engine(engine, cfg, setup, env)
    if own is not None:
        optimizer = own
        lr_scheduler = lr_scheduler or lr_schedule(cfg.optim.scheduler, optimizer, warmup,
                                                   max(total_steps, 1))
    return engine, optimizer, lr_scheduler


def make_optimizer(model: torch.nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW / SGD over the trainable parameters; no weight decay on biases and norm weights."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # ZeRO-3 parameters are flat shards: the rule goes by their real shape
            (decay if len(ds_config.full_shape(p)) >= 2 else no_decay).append(p)
    # `decay`: which group a live `set weight_decay` changes (engine.control.live_fields)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay, "decay": True},
              {"params": no_decay, "weight_decay": 0.0, "decay": False}]
    groups = [g for g in groups if g["params"]]
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.optim.lr)
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)


def _model_hidden(model) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "hidden_size", None) if config is not None else None
