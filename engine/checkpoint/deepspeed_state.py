"""DeepSpeed's part of a training checkpoint: the model, optimizer and schedule in this layout's
partitions, saved and loaded through the engine's own save_checkpoint / load_checkpoint, with the
two cases DeepSpeed does not handle by itself (a placeholder optimizer, a bf16 pipeline at ZeRO 0).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from engine.checkpoint.locations import CheckpointError
from engine.model.loading import is_quantized


def placeholder_optimizer(engine) -> bool:
    """True when DeepSpeed's optimizer holds no state at all: LOMO / AdaLomo (whose fused
    optimizer the loop saves itself, loop/) at bf16, where DeepSpeed wraps a placeholder (its
    DummyOptim, without a state_dict) in a BF16_Optimizer it leaves uninitialised."""
    from deepspeed.runtime.utils import DummyOptim
    optimizer = engine.optimizer
    return isinstance(optimizer, DummyOptim) or isinstance(getattr(optimizer, "optimizer", None), DummyOptim)


def save_engine_state(engine, folder: str, tag: str, client_state: dict) -> None:
    """DeepSpeed's part of a checkpoint (model, optimizer, schedule) into `folder`/`tag`
    (collective). A placeholder optimizer (`placeholder_optimizer`) is kept out of it: DeepSpeed
    would ask it for the state it does not have."""
    if not placeholder_optimizer(engine):
        engine.save_checkpoint(folder, tag=tag, client_state=client_state, save_latest=False)
        return
    optimizer, zero_file = engine.optimizer, engine.save_zero_checkpoint
    engine.optimizer, engine.save_zero_checkpoint = None, False
    try:
        engine.save_checkpoint(folder, tag=tag, client_state=client_state, save_latest=False)
    finally:
        engine.optimizer, engine.save_zero_checkpoint = optimizer, zero_file


def load_engine_state(engine, local: Path, tag: str, *, scheduler: bool = True) -> None:
    """DeepSpeed's part of a checkpoint (`local`/`tag`) into the running `engine`: the model, the
    optimizer and, when `scheduler`, the learning-rate schedule. Collective.

    One layout needs help: DeepSpeed 0.19 runs a bf16 pipeline at ZeRO 0 with its BF16_Optimizer,
    saves that optimizer in the per-data-parallel-rank file (bf16_zero_pp_rank_<dp>_mp_rank_<mp>_
    optim_states.pt) as it does for ZeRO, but loads it like a plain optimizer: the one state dict of
    the model-states file goes where BF16_Optimizer.load_state_dict expects the list of every data
    rank's (`state_dict_list[dp_rank]`: KeyError 0). There DeepSpeed loads the model and schedule,
    and the optimizer is handed its own file, in the form it reads (its fp32 master weights too).
    """
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    placeholder = placeholder_optimizer(engine)  # nothing was saved of it (save_engine_state)
    own_file = isinstance(engine.optimizer, BF16_Optimizer) and not engine.zero_optimization() and not placeholder
    # a quantized base's saved state has bitsandbytes' quantization constants beside each packed
    # weight, which a loaded (already quantized) module does not take back as keys; the base is
    # rebuilt bit for bit from its folder; the adapter loads under the names it was saved with
    strict = not is_quantized(engine.module)
    load_path, _ = engine.load_checkpoint(str(local), tag=tag, load_module_strict=strict,
                                          load_optimizer_states=not (own_file or placeholder),
                                          load_lr_scheduler_states=scheduler)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint {tag} in {local}")
    if own_file:
        optimizer = engine.optimizer
        group = optimizer.dp_process_group
        dp_rank, dp_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        # DeepSpeed's own name for this rank's file (what its save wrote)
        saved = torch.load(engine._get_zero_ckpt_name(str(local), tag), map_location="cpu", weights_only=False)
        states: list[dict | None] = [None] * dp_size
        states[dp_rank] = saved["optimizer_state_dict"]
        optimizer.load_state_dict(states, load_optimizer_states=True,
                                  load_from_fp32_weights=engine.zero_load_from_fp32_weights())
