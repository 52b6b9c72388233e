"""Whole-model weights of a split (tensor- or pipeline-parallel) model, and back.

Plain functions of the engine and the rank's place (`DistEnv`); the layout objects in
`engine.parallel.layouts` call them. Gathering is collective (every rank calls it): under tensor
parallelism the shards are gathered layer by layer (DeepSpeed's consolidation), under pipeline
parallelism the first data-parallel replica's stages send their layers to rank 0. Loading
refreshes the optimizer's full-precision master weights, so the next step starts from the
loaded weights.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from engine.context import DistEnv


def hf_config_of(module):
    """The Hugging Face config of the engine's module (a pipeline stage keeps it as hf_config)."""
    return getattr(module, "hf_config", None) or module.config


def tied_aliases(module) -> set[str]:
    """Names under which a module holds a parameter it already holds under an earlier name."""
    seen, aliases = set(), set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases


def gather_stages(module, env: DistEnv) -> dict[str, torch.Tensor] | None:
    """A pipeline's whole model on global rank 0 (None elsewhere): the first replica's stages
    send their layers (collective over the world)."""
    mine = None
    if env.dp_rank == 0:  # one replica's stages make up the whole model
        mine = {k: v.detach().cpu() for k, v in module.hf_state_dict().items()}
    gathered = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if env.rank != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered or []:
        merged.update(part or {})
    return merged


def whole_model_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole (unsplit) model and its shape, Hugging Face names, tied copies
    once: what a Hugging Face folder for this model must hold. Built on the meta device."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    aliases = tied_aliases(skeleton)
    return {k: tuple(v.shape) for k, v in skeleton.state_dict().items() if k not in aliases}


def shape_problems(hf_config, file_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What keeps a folder's tensors (name -> shape) from loading into the whole model: missing,
    unexpected (beyond tied copies) and misshapen tensors; empty when they fit."""
    want = whole_model_shapes(hf_config)
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


def model_files_source(module):
    """What config.json and generation_config.json are written from: the model itself, or under
    pipeline parallelism (the engine holds only a stage) its config and a generation config
    made from it."""
    if not hasattr(module, "hf_config"):
        return module
    from transformers import GenerationConfig
    return SimpleNamespace(config=module.hf_config, generation_config=GenerationConfig.from_model_config(module.hf_config))


def untied_missing(module, missing: list[str], state_dict: dict) -> list[str]:
    """The missing keys that are not a tied copy of a loaded weight (lm_head = embed_tokens)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state_dict if k in params}
    return [k for k in missing if k not in params or id(params[k]) not in loaded]


def raise_if_missing(missing: list[str]) -> None:
    if missing:
        raise ValueError(f"the weights lack {len(missing)} of this model's tensors: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))

