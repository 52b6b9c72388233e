"""The DeepSpeed layer of the running engine. The config itself is built torch-free in
`contract.deepspeed_config` (the Hugging Face `"auto"` convention, every contradiction in one
error; the pre-flight check runs the same code before any rank starts); this module adds what
needs the hardware or a live engine: the precision probe, ZeRO-3 construction, and every
DeepSpeed internal the engine touches.

ZeRO-3: build models inside :func:`zero3_init`, and Hugging Face models through `from_config` /
`from_pretrained` there: those initialise (or load) the weights on the shards. Calling a model
class directly under zero.Init leaves torch's default init, as the Hugging Face init then only
sees empty shards.

Only this module and engine/assembly/model.py talk to deepspeed directly; deepspeed and transformers are
imported lazily so that building a config stays cheap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from contract.config.schema import ConfigError

# The config builder ("auto" filling, every contradiction collected) is torch-free and lives in
# the contract, where the pre-flight check runs it before any rank starts; the precision names too.
from contract.deepspeed_config import PRECISIONS


# -- precision ----------------------------------------------------------------------------------

def resolve_precision(requested: str) -> str:
    """"auto" -> bf16 where the hardware does bf16 fast, else fp32; explicit choices are checked.

    CUDA: torch.cuda.is_bf16_supported(). CPU: the avx512_bf16 / amx_bf16 flags (torch's
    get_cpu_capability() only says "AVX512", not whether bf16 is native). DeepSpeed's fp16 needs
    an accelerator that its own check accepts: any CUDA GPU, or a CPU with native fp16.
    """
    if requested not in ("auto", *PRECISIONS):
        raise ConfigError([("train.precision", f"must be one of auto, {', '.join(PRECISIONS)}, got {requested!r}")])
    if requested == "fp32":
        return "fp32"
    if requested == "auto":
        return "bf16" if _bf16_fast() else "fp32"
    if requested == "bf16" and not _bf16_works():
        raise ConfigError([("train.precision", "bf16 is not supported by this hardware"
                            + ("" if torch.cuda.is_available() else
                               " (a CPU needs AVX-512 for it; this one would emulate it many times slower than fp32)")
                            + "; use fp32" + (" or fp16" if torch.cuda.is_available() else ""))])
    if requested == "fp16" and not _fp16_works():
        raise ConfigError([("train.precision", "DeepSpeed's fp16 needs a CUDA GPU or a CPU with native fp16 "
                            "(AVX512-FP16 / AMX-FP16); this machine has neither; use "
                            + ("bf16 or fp32" if _bf16_works() else "fp32"))])
    return requested


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def _bf16_fast() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _bf16_works() -> bool:
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return _bf16_fast() or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _fp16_works() -> bool:
    if torch.cuda.is_available():
        return True
    from deepspeed.accelerator import get_accelerator
    return bool(get_accelerator().is_fp16_supported())  # the check deepspeed.initialize makes


# -- ZeRO-3 aware model construction -----------------------------------------------------------

_TRANSFORMERS_ZERO3: Any = None  # transformers keeps only a weakref; this keeps it alive


def transformers_zero3(ds_config: dict) -> Any:
    """Tell transformers the process runs under ZeRO-3 with `ds_config` (None and off otherwise).

    transformers reads a weakly referenced HfDeepSpeedConfig: `from_pretrained` / `from_config`
    then build partitioned and load each shard (`is_deepspeed_zero3_enabled`), `generate`
    defaults to synced_gpus, and peft gathers sharded weights. Those matter for the whole run,
    not only while the model is built, so the object is held here until the next call or
    :func:`release_transformers_zero3`.
    """
    global _TRANSFORMERS_ZERO3
    if ds_config.get("zero_optimization", {}).get("stage") != 3:
        release_transformers_zero3()
        return None
    from transformers.integrations import HfDeepSpeedConfig
    _TRANSFORMERS_ZERO3 = HfDeepSpeedConfig(ds_config)
    return _TRANSFORMERS_ZERO3


def release_transformers_zero3() -> None:
    """Switch transformers' ZeRO-3 mode off again (a later run in the same process may not use it)."""
    global _TRANSFORMERS_ZERO3
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    unset_hf_deepspeed_config()
    _TRANSFORMERS_ZERO3 = None


@contextlib.contextmanager
def zero3_init(ds_config: dict) -> Iterator[None]:
    """Build models inside this to have them partitioned at construction under ZeRO-3, so no
    rank ever holds the whole model; without stage 3 it does nothing (and turns transformers'
    ZeRO-3 mode off).

    Inside: deepspeed.zero.Init for any torch module, plus :func:`transformers_zero3`, which
    makes Hugging Face models initialise their weights correctly on the shards and makes
    `from_pretrained` load partitioned; its own nested zero.Init is harmless.
    """
    if transformers_zero3(ds_config) is None:
        yield
        return
    import deepspeed
    import torch._dynamo  # noqa: F401  imported lazily under zero.Init it fails (patched Tensor.__new__)
    from transformers.integrations.deepspeed import prevent_arange_dtype_change
    # prevent_arange_dtype_change keeps RoPE's arange-built buffers in fp32 under bf16/fp16 (it
    # must be entered before zero.Init, which casts tensor constructors to the training dtype)
    with prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=ds_config):
        yield


# -- the running engine's internals (only this layer and the assembly touch them) -----------------

def refresh_master_weights(engine) -> None:
    """Make the optimizer's fp32 master copy follow weights changed in the module (bf16 / fp16 /
    ZeRO wrappers keep their own)."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()


def consolidated_state_dict(engine) -> dict | None:
    """The whole model's 16-bit weights gathered from AutoTP / ZeRO-3 shards (collective): a
    state dict with the model's own names on global rank 0, None elsewhere."""
    return engine._consolidated_16bit_state_dict()


def universal_checkpoint_info() -> dict:
    """The client state DeepSpeed's universal checkpoint conversion asks for when no tensor needs
    merge patterns (plain data parallelism): only the format version."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)
    return {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def backward_leftovers_release(engine):
    """Under ZeRO-3 without a DeepSpeed optimizer: the engine's release of parameters no module
    hook released in backward (DeepSpeed's own optimizer calls it at the end of backward); None
    otherwise."""
    return getattr(engine.optimizer, "release_backward_leftovers", None)


def set_gradient_clipping(engine, value: float) -> None:
    """Change a running engine's gradient clipping norm (0: off). DeepSpeed reads it from its
    config (ZeRO 0) or from its optimizer wrapper (ZeRO, bf16 / fp16 wrappers), both set once at
    start: change both. The control plane's `set grad_clip` comes through here."""
    engine._config.gradient_clipping = value
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = value


class _RecordingEngine:
    """Stands in for DeepSpeed's checkpoint engine during a save and notes every file it writes,
    so that each rank hashes (and, for a remote URL, uploads) exactly its own files."""

    def __init__(self, inner):
        self._inner, self.written = inner, []

    def save(self, state_dict, path):
        self._inner.save(state_dict, path)
        self.written.append(path)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@contextlib.contextmanager
def recording_checkpoint_files(engine) -> Iterator[list[str]]:
    """Within: `engine.save_checkpoint` as usual, and the list yielded fills with the paths of
    the files this rank wrote. DeepSpeed's decoupled (asynchronous) checkpoint engine is refused:
    a checkpoint is published only once all of its files are written."""
    inner = engine.checkpoint_engine
    if inner is not None and inner.is_decoupled():
        raise ValueError("DeepSpeed's decoupled (asynchronous) checkpoint engine is not supported: "
                         "a checkpoint is published only once all of its files are written")
    recorder = _RecordingEngine(inner)
    engine.checkpoint_engine = recorder
    try:
        yield recorder.written
    finally:
        engine.checkpoint_engine = inner


# -- ZeRO-3 partitioned parameters and AutoTP layers ----------------------------------------------

def is_partitioned(t: Any) -> bool:
    """True for a ZeRO-3 parameter (its data is this rank's flat shard)."""
    return hasattr(t, "ds_id")


def full_shape(t: Any) -> tuple[int, ...]:
    """A tensor's real shape (ZeRO-3 keeps it in ds_shape while the data is a flat shard)."""
    return tuple(getattr(t, "ds_shape", t.shape))


def gathered(params: list, modifier_rank: int | None = None):
    """A context in which the ZeRO-3 parameters `params` are whole on every rank (collective);
    with `modifier_rank`, what that rank writes into them is partitioned again on exit. Does
    nothing for parameters that are not partitioned."""
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    return GatheredParameters(params, modifier_rank=modifier_rank)


def write_partition(p: Any, full: Any) -> None:
    """Copy this rank's slice of the updated whole parameter `full` into its ZeRO-3 partition
    (the partition is what the next gather reads)."""
    import torch.distributed as dist
    shard = p.ds_tensor
    start = dist.get_rank(group=p.ds_process_group) * shard.numel()
    n = max(0, min(shard.numel(), full.numel() - start))
    if n:
        shard.view(-1)[:n].copy_(full.reshape(-1)[start:start + n])


def init_tensor_parallel_mesh(tp_size: int) -> Any:
    """Create DeepSpeed's data x tensor mesh (what deepspeed.initialize calls when it is not
    given an mpu; a second call in the same process keeps the first mesh) and return DeepSpeed's
    groups module, which answers the ranks and groups of that mesh."""
    from deepspeed.utils import groups
    groups._init_tp_mesh_device(tensor_model_parallel_size=tp_size)
    return groups


def gathered_autotp_layer(params: list, module: Any):
    """A context in which the AutoTP-sharded parameters `params` of `module` are whole; what is
    written into them is cut into this rank's shard again on exit (collective over the tensor group)."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams
    return GatherReplacedLayerParams(params, module, enabled=True)


def tensor_parallel_groups() -> Any:
    """DeepSpeed's groups module: the model-parallel unit deepspeed.initialize gets under tensor
    parallelism (its data x tensor mesh, made by :func:`init_tensor_parallel_mesh`)."""
    from deepspeed.utils import groups
    return groups
