"""The fused LOMO / AdaLomo step strategy and the builders its method object (engine.model.methods) calls."""

from __future__ import annotations

import torch

from contract.config.schema import RunConfig
from engine.parallel import ds_config
from engine.data import count_tokens
from engine.steps import step_window
from engine.lomo.fused import FusedOptimizer
from engine.lomo.rules import AdaLomoRule, LomoRule, UpdateRule
from engine.lomo.scaler import scaler_from_ds_config


class FusedStep:
    """One optimizer step of LOMO / AdaLomo: forward and a backward that updates as it goes.

    The forward goes through the bare module, not the DeepSpeed engine: DeepSpeed (0.19) hooks
    the engine's outputs so that their backward demands `engine.backward`, which in turn demands
    a DeepSpeed optimizer, and LOMO deliberately has none. The engine's module is the same model
    (partitioned under ZeRO-3, where its own hooks still gather the parameters).
    """

    def __init__(self, method: str):
        self.method = method  # "lomo" or "adalomo", for messages

    def __call__(self, trainer, micro_batches: list[dict]) -> tuple[torch.Tensor, int]:
        if len(micro_batches) != 1:
            raise ValueError(f"train.grad_accum: {self.method} updates inside backward and cannot "
                             f"accumulate {len(micro_batches)} micro-batches; set grad_accum 1")
        (batch,) = micro_batches
        optimizer = trainer.optimizer
        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError(f"method.name {self.method} needs the fused optimizer engine setup builds "
                            f"(got {type(optimizer).__name__}); do not pass an optimizer of your own")
        window = step_window(trainer, micro_batches)
        # the fused optimizer averages gradients over the ranks: `scale` undoes that for the
        # token-weighted loss (both passes, measure and update, go through this closure)
        loss = optimizer.fused_step(
            lambda: trainer.compute_loss(batch, model=trainer.engine.module, window=window) * window.scale)
        if not optimizer.last_skipped and trainer.lr_scheduler is not None:
            trainer.lr_scheduler.step()  # a skipped step does not advance the schedule (as DeepSpeed)
        return loss.float(), count_tokens(batch)


def rule_of(cfg: RunConfig) -> UpdateRule:
    return AdaLomoRule() if cfg.method.name == "adalomo" else LomoRule()


def build_optimizer(engine, cfg: RunConfig, deepspeed_config: dict, dp_group, dp_size: int) -> FusedOptimizer:
    """The fused optimizer over the engine's trainable parameters (partitioned under ZeRO-3),
    from the run config (optim.lr, optim.weight_decay, optim.grad_clip) and the DeepSpeed
    config's fp16 loss-scale settings (`deepspeed_config`)."""
    # ZeRO-3 without a DeepSpeed optimizer: the engine's parameter offloader releases what no
    # module hook released in backward (DeepSpeed's own optimizer calls it at the end of backward)
    release = ds_config.backward_leftovers_release(engine)
    return FusedOptimizer(engine.module.parameters(), rule_of(cfg), lr=cfg.optim.lr,
                          weight_decay=cfg.optim.weight_decay, max_grad_norm=cfg.optim.grad_clip,
                          scaler=scaler_from_ds_config(deepspeed_config), dp_group=dp_group, dp_size=dp_size,
                          after_backward=release)


def prepare_ds_setup(setup, method: str) -> None:
    """Fit a built DeepSpeed set-up to a fused method (in place).

    ZeRO 1 and 2 shard optimizer state and gradients; LOMO keeps neither, and DeepSpeed refuses
    those stages without a DeepSpeed-wrapped optimizer, so they run as stage 0 (said in a warning).
    A DeepSpeed "optimizer" section would fight the fused update: an error.
    """
    config = setup.config
    if setup.ds_optimizer or "optimizer" in config:
        raise ValueError(f'parallel.deepspeed.optimizer: {method} updates the weights itself; remove the '
                         'DeepSpeed "optimizer" (and "scheduler") section')
    zero = config.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage in (1, 2):
        zero["stage"] = 0
        setup.warnings.append(f"{method} keeps no optimizer state and no full set of gradients, so ZeRO "
                              f"stage {stage} has nothing to shard: it runs as stage 0")
    for key in ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"):
        config.pop(key, None)
    zero.pop("offload_optimizer", None)
