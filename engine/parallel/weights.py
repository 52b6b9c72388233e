"""One ordinary Hugging Face model from any tp / pp layout, and back.

    full_state_dict(trainer)            whole-model weights, Hugging Face names, on rank 0
    load_full_state_dict(trainer, sd)   split whole-model weights into this rank's layout
    shape_problems(trainer, shapes)     what keeps a folder's tensors from fitting the whole model

engine.checkpoint's save_model / load_model use them under tp or pp (atomic folders, shards,
fsspec as for every layout). The first two are collective (every rank calls them). Under
tensor parallelism the shards are gathered layer by layer (DeepSpeed's consolidation); under
pipeline parallelism the first data-parallel replica's stages send their layers to rank 0. Loading refreshes the optimizer's
full-precision master weights, so the next step starts from the loaded weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.parallel import tp


def is_split(trainer) -> bool:
    """True when this trainer's model is split by tensor or pipeline parallelism."""
    return trainer.env.tp_size > 1 or trainer.env.pp_size > 1


def hf_config_of(trainer):
    module = trainer.engine.module
    return getattr(module, "hf_config", None) or module.config


def full_state_dict(trainer) -> dict[str, torch.Tensor] | None:
    """The whole model's weights under their Hugging Face names on global rank 0, None on the
    other ranks (collective)."""
    engine, env = trainer.engine, trainer.env
    if env.pp_size > 1:
        return _gather_stages(trainer)
    if env.tp_size > 1:
        state = tp.full_state_dict(engine)
        # DeepSpeed's consolidation lists a tied weight under both names; keep the first, as
        # save_pretrained does
        return None if state is None else {k: v for k, v in state.items() if k not in tied_aliases(engine.module)}
    if env.rank != 0:
        return None
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}


def _gather_stages(trainer) -> dict[str, torch.Tensor] | None:
    env = trainer.env
    mine = None
    if env.dp_rank == 0:  # one replica's stages make up the whole model
        mine = {k: v.detach().cpu() for k, v in trainer.engine.module.hf_state_dict().items()}
    gathered = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if env.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def tied_aliases(module) -> set[str]:
    """Names under which a module holds a parameter it already holds under an earlier name."""
    seen, aliases = set(), set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases


def whole_model_shapes(trainer) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole (unsplit) model and its shape, Hugging Face names, tied copies
    once: what a Hugging Face folder for this layout must hold. Built on the meta device."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config_of(trainer))
    aliases = tied_aliases(skeleton)
    return {k: tuple(v.shape) for k, v in skeleton.state_dict().items() if k not in aliases}


def shape_problems(trainer, file_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What keeps a folder's tensors (name -> shape) from loading into this layout: missing,
    unexpected (beyond tied copies) and misshapen tensors; empty when they fit."""
    want = whole_model_shapes(trainer)
    missing = sorted(set(want) - set(file_shapes))
    unexpected = sorted(k for k in set(file_shapes) - set(want) if not k.endswith("lm_head.weight"))
    wrong = [f"{k}: file {file_shapes[k]}, model {want[k]}" for k in sorted(set(want) & set(file_shapes))
             if tuple(file_shapes[k]) != want[k]]
    problems = []
    for label, items in (("missing from the folder", missing), ("not in the model", unexpected),
                         ("shapes differ", wrong)):
        if items:
            problems.append(f"{label}: {', '.join(items[:6])}" + (f" and {len(items) - 6} more" if len(items) > 6 else ""))
    return problems


def model_files_source(trainer):
    """What the checkpoint layer writes config.json and generation_config.json from: the model
    itself under tensor parallelism, its config (and a generation config made from it) under
    pipeline parallelism, where the engine holds only a stage."""
    module = trainer.engine.module
    if not hasattr(module, "hf_config"):
        return module
    from types import SimpleNamespace

    from transformers import GenerationConfig
    return SimpleNamespace(config=module.hf_config, generation_config=GenerationConfig.from_model_config(module.hf_config))


def load_full_state_dict(trainer, state_dict: dict[str, torch.Tensor]) -> None:
    """Put whole-model weights (Hugging Face names; every rank passes the same) into the
    engine's layout; raises ValueError naming the weights the model needs and did not get."""
    engine, env = trainer.engine, trainer.env
    if env.pp_size > 1:
        missing = engine.module.load_hf_state_dict(state_dict)
    elif env.tp_size > 1:
        missing = tp.load_full_state_dict(engine.module, state_dict)
    else:
        missing = _untied(engine.module, engine.module.load_state_dict(state_dict, strict=False).missing_keys,
                          state_dict)
    if missing:
        raise ValueError(f"the weights lack {len(missing)} of this model's tensors: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    refresh_master_weights(engine)


def _untied(module, missing: list[str], state_dict: dict) -> list[str]:
    """The missing keys that are not a tied copy of a loaded weight (lm_head = embed_tokens)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state_dict if k in params}
    return [k for k in missing if k not in params or id(params[k]) not in loaded]


def refresh_master_weights(engine) -> None:
    """Copy the module's (possibly 16-bit) weights into the optimizer's fp32 masters, where the
    optimizer keeps its own (bf16 / fp16 / ZeRO wrappers)."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()
