"""PEFT adapters: PEFT's own layout out of the engine and back in, and the merged LoRA export.

`save_peft` writes each selected adapter as `adapter_config.json` + `adapter_model.safetensors`
(the "default" adapter in the folder, others in a sub-folder named after them; PEFT's own
`save_pretrained` does the writing), so `PeftModel.from_pretrained(base, path)` loads it. Under
ZeRO-3 only the adapter parameters are gathered, never the base model. `load_peft` loads an
adapter's weights into the engine's adapter of that name (keys and shapes checked before any
weight changes); a new adapter can join only for inference and not under ZeRO-3, because the
engine's optimizer and partitioning were built around the adapters it started with. Without PEFT
the run's method (engine.model.methods) falls back to the model functions, as in CoLLie.

`export_merged` writes base + LoRA as a plain Hugging Face model: each LoRA layer's base weight
plus its delta (PEFT's `get_delta_weight`, what `merge_and_unload` adds) is made shard by shard
through the streaming writer of `models.py`, so nothing is ever merged in place.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path

import torch

from engine.context import RunContext
from engine.parallel import ds_config
from engine.checkpoint import atomic, models
from engine.checkpoint.locations import CheckpointError
from engine.checkpoint.agreement import Comm
from contract.events import ExportEvent

ADAPTER_CONFIG = "adapter_config.json"


class AdapterError(CheckpointError):
    pass


def is_peft(module) -> bool:
    """Whether `module` is a peft `PeftModel`. Asked of every run's model: a PeftModel exists
    only once peft is imported, so without peft in sys.modules the answer is no, and a run that
    uses no PEFT never imports it (~4 s a rank: peft imports bitsandbytes, whose import runs
    torch.compile, and transformers' bloom model; tests/test_import_cost.py)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def check_adapter_names(module, selected: list[str] | None) -> list[str]:
    """The selected adapters (all when None); an unknown name is an error listing the known."""
    known = list(module.peft_config)
    names = known if selected is None else list(selected)
    unknown = [n for n in names if n not in module.peft_config]
    if unknown or not names:
        raise AdapterError(f"no adapter named {', '.join(map(repr, unknown)) or '(none selected)'}; "
                           f"this model has: {', '.join(known)}")
    return names


def adapter_params(module, names: list[str]) -> list[torch.nn.Parameter]:
    """The parameters of the named adapters (their name has the adapter as one component)."""
    return [p for n, p in module.named_parameters() if any(f".{a}." in f".{n}." for a in names)]


def _any_partitioned(params) -> bool:
    return any(models.is_partitioned(p) for p in params)


# -- saving ------------------------------------------------------------------------------------
def save_peft(run: RunContext, path: str, selected_adapters: list[str] | None = None) -> dict:
    """Selected adapters (all when None) in PEFT's layout at `path`; collective, rank 0 writes."""
    module = run.engine.module
    if not is_peft(module):
        raise AdapterError("save_peft needs a PEFT model; this run trains the model itself (save_model)")
    names = check_adapter_names(module, selected_adapters)
    started, comm = time.perf_counter(), Comm.current()
    params = adapter_params(module, names)
    meta = {"step": run.state.global_step, "adapters": names}
    prompts = _prompt_embeddings(module, names, params)
    with atomic.writing(path, kind="adapter", meta=meta, comm=comm) as w, _saving_prompts(module, prompts):
        with ds_config.gathered(params, modifier_rank=None):
            if comm.rank == 0:
                # under ZeRO-3 the module's own state_dict is read inside the gather, where the
                # adapter tensors are whole (the base tensors are empty shards, and filtered out)
                extra = {"state_dict": module.state_dict()} if _any_partitioned(params) else {}
                module.save_pretrained(str(w.local), selected_adapters=names, safe_serialization=True, **extra)
                if run.tokenizer is not None:
                    run.tokenizer.save_pretrained(str(w.local))
    info = {"adapters": names, "bytes": sum(p.numel() * p.element_size() for p in params),
            "seconds": time.perf_counter() - started}
    run.emit(ExportEvent(kind="adapter", path=str(path), step=run.state.global_step, **info))
    return info


def _prompt_embeddings(module, names: list[str], params) -> dict[str, torch.Tensor]:
    """The virtual-token embeddings of the prompt-learning adapters among `names`, computed on
    every rank. peft saves such an adapter by running its prompt encoder; under ZeRO-3 that
    forward is collective, so on rank 0 alone (where peft would run it) it waits forever."""
    if not _any_partitioned(params):
        return {}
    with torch.no_grad():
        return {n: module.get_prompt_embedding_to_save(adapter_name=n).detach().cpu()
                for n in names if module.peft_config[n].is_prompt_learning}


@contextlib.contextmanager
def _saving_prompts(module, prompts: dict[str, torch.Tensor]):
    """peft's save_pretrained takes the embeddings computed by every rank, not a forward of its own."""
    if not prompts:
        yield
        return
    module.get_prompt_embedding_to_save = lambda adapter_name: prompts[adapter_name]
    try:
        yield
    finally:
        del module.get_prompt_embedding_to_save  # the class's method again


# -- loading -----------------------------------------------------------------------------------
def load_peft(run: RunContext, path: str, adapter_name: str = "default", is_trainable: bool = True) -> None:
    """Load the adapter saved at `path` (or its `adapter_name` sub-folder) into the engine."""
    if not is_peft(run.engine.module):
        raise AdapterError("load_peft needs a PEFT model; this run trains the model itself (load_model)")
    local, temporary = models.fetch_model_folder(path, Comm.current())
    try:
        folder = local / adapter_name if (local / adapter_name / ADAPTER_CONFIG).is_file() else local
        load_adapter_files(run, folder, str(path), adapter_name, is_trainable)
    finally:
        if temporary:
            shutil.rmtree(local, ignore_errors=True)


def load_model_folder(run: RunContext, path: str) -> None:
    """A folder into a PEFT model (collective): an adapter folder loads as the trained adapter,
    a plain model folder into the base model's weights."""
    comm = Comm.current()
    local, temporary = models.fetch_model_folder(path, comm)
    try:
        if (local / ADAPTER_CONFIG).is_file():
            return load_adapter_files(run, local, str(path), run.config.method.adapter_name, True)
        targets, aliases = base_tensors(run.engine.module)
        models.load_local(run, local, str(path), targets, aliases, comm)
    finally:
        if temporary:
            shutil.rmtree(local, ignore_errors=True)


def load_adapter_files(run: RunContext, folder: Path, where: str, adapter_name: str, is_trainable: bool) -> None:
    """Adapter weights from a local PEFT folder into the engine's adapter `adapter_name`."""
    import peft
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    module, comm = run.engine.module, Comm.current()
    if not (folder / ADAPTER_CONFIG).is_file():
        raise AdapterError(f"{where} is not a PEFT adapter folder: {ADAPTER_CONFIG} is missing")
    saved = peft.PeftConfig.from_pretrained(str(folder))
    if adapter_name not in module.peft_config:
        return _add_inference_adapter(run, folder, where, adapter_name, is_trainable)
    _check_config(saved, module.peft_config[adapter_name], where, adapter_name)
    weights = load_peft_weights(str(folder), device="cpu")
    _check_weights(module, weights, adapter_name, where)
    params = adapter_params(module, [adapter_name])
    with torch.no_grad(), ds_config.gathered(params, modifier_rank=0):
        if comm.rank == 0 or not _any_partitioned(params):
            result = set_peft_model_state_dict(module, weights, adapter_name=adapter_name)
            unexpected = [k for k in getattr(result, "unexpected_keys", []) if f".{adapter_name}." in f".{k}."]
            if unexpected:  # _check_weights makes this unreachable; kept as a last guard
                raise AdapterError(f"{where}: keys the adapter does not have: {unexpected[:6]}")
    ds_config.refresh_master_weights(run.engine)


def _add_inference_adapter(run: RunContext, folder: Path, where: str, adapter_name: str, is_trainable: bool) -> None:
    module = run.engine.module
    known = ", ".join(module.peft_config)
    if is_trainable:
        raise AdapterError(f"cannot add the trainable adapter {adapter_name!r} from {where} to the running "
                           f"engine: its optimizer holds the adapters {known}; load it into one of those, "
                           f"pass is_trainable=False, or start a run with method.adapter_name={adapter_name}")
    if _any_partitioned(list(module.parameters())):
        raise AdapterError(f"cannot add the adapter {adapter_name!r} to a ZeRO-3 engine (its new parameters "
                           f"would not be partitioned); load it into one of the adapters {known}")
    module.load_adapter(str(folder), adapter_name, is_trainable=False)


def _check_config(saved, current, where: str, adapter_name: str) -> None:
    fields = ("peft_type", "r", "lora_alpha", "target_modules", "num_virtual_tokens", "use_dora")
    differ = []
    for f in fields:
        a, b = getattr(saved, f, None), getattr(current, f, None)
        a, b = (sorted(a) if isinstance(a, (set, list)) else a), (sorted(b) if isinstance(b, (set, list)) else b)
        if a != b:
            differ.append(f"{f}: saved {a!r}, engine {b!r}")
    if differ:
        raise AdapterError(f"the adapter in {where} does not match the engine's adapter {adapter_name!r} "
                           f"({'; '.join(differ)}); nothing was loaded")


def expected_adapter_shapes(module, adapter_name: str) -> dict[str, tuple[int, ...]]:
    """The keys and shapes a saved `adapter_name` has, computed without touching any data."""
    from peft.utils import get_peft_model_state_dict

    config = module.peft_config[adapter_name]
    if config.is_prompt_learning:
        tokens = config.num_virtual_tokens * config.num_transformer_submodules
        return {"prompt_embeddings": (tokens, config.token_dim)}
    meta = {n: torch.empty(s, device="meta") for n, s in
            ((n, models.full_shape(t)) for n, t in module.state_dict(keep_vars=True).items())}
    return {k: tuple(v.shape) for k, v in
            get_peft_model_state_dict(module, state_dict=meta, adapter_name=adapter_name,
                                      save_embedding_layers=False).items()}


def _check_weights(module, weights: dict, adapter_name: str, where: str) -> None:
    expected = expected_adapter_shapes(module, adapter_name)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [f"{k}: file {tuple(weights[k].shape)}, engine {expected[k]}"
             for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
    problems = [f"{label}: {models._few(items)}" for label, items in
                (("missing", missing), ("not in the adapter", unexpected), ("shapes differ", wrong)) if items]
    if problems:
        raise AdapterError(f"the adapter weights in {where} do not fit the engine's adapter "
                           f"{adapter_name!r} ({'; '.join(problems)}); nothing was loaded")


# -- the base model's tensors and the merged export --------------------------------------------
def _adapter_prefixes(base) -> list[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    prefixes = []
    for path, mod in base.named_modules():
        if isinstance(mod, BaseTunerLayer):
            for attr in (*mod.adapter_layer_names, *getattr(mod, "other_param_names", ())):
                prefixes.append(f"{path}.{attr}.")
        if isinstance(mod, ModulesToSaveWrapper):  # the trained copies; the original is the base
            prefixes.append(f"{path}.modules_to_save.")
    return prefixes


def hf_key(name: str) -> str:
    """A base-model tensor's name as the plain model has it (PEFT wraps layers in base_layer)."""
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def base_tensors(module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The base model's tensors under their plain Hugging Face keys (adapters left out), and the
    aliases of tied ones."""
    base = module.get_base_model()
    prefixes = _adapter_prefixes(base)
    targets = {hf_key(n): t for n, t in models.named_tensors(base) if not n.startswith(tuple(prefixes))}
    return targets, models.tensor_aliases(base, rename=hf_key)


def export_merged(run: RunContext, path: str, adapter_name: str | None = None,
                  max_shard_size: int | str = models.DEFAULT_SHARD_SIZE) -> dict:
    """Base weights + the LoRA adapter `adapter_name` (the trained one when None) as a plain
    Hugging Face model at `path`; collective, the engine's weights are left as they are."""
    from peft.tuners.lora import LoraLayer

    module = run.engine.module
    if not is_peft(module):
        raise AdapterError("export_merged needs a PEFT model; this run trains the model itself (save_model)")
    name = adapter_name or run.config.method.adapter_name
    check_adapter_names(module, [name])
    config = module.peft_config[name]
    if config.peft_type.value != "LORA" or getattr(config, "use_dora", False):
        raise AdapterError(f"only plain LoRA adapters merge into the base weights; {name!r} is "
                           f"{config.peft_type.value}{' with DoRA' if getattr(config, 'use_dora', False) else ''}: "
                           "save it with save_peft")
    base = module.get_base_model()
    lora_of = {id(m.get_base_layer().weight): m for m in base.modules()
               if isinstance(m, LoraLayer) and (name in m.lora_A or name in getattr(m, "lora_embedding_A", {}))}
    targets, _ = base_tensors(module)
    quantized = _quantized_layers(base)
    plain = _plain_dtype(base) if quantized else None
    entries = [_merged_entry(k, t, lora_of.get(id(t)), name, quantized.get(id(t)), plain) for k, t in targets.items()]
    return models.save_hf(run, path, base, entries, max_shard_size, kind="model")


def _quantized_layers(base) -> dict[int, torch.nn.Module]:
    """A quantized base's bitsandbytes linear layers, by their weight's id (empty for a plain base)."""
    try:
        import bitsandbytes as bnb
    except ImportError:  # without bitsandbytes no base is quantized
        return {}
    return {id(m.weight): m for m in base.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def _plain_dtype(base) -> torch.dtype:
    """What a quantized base is exported in: its 4-bit layers' compute dtype, else (8-bit) the
    dtype the model was loaded in."""
    q = base.config.quantization_config
    q = q.to_dict() if hasattr(q, "to_dict") else dict(q)
    if q.get("load_in_4bit"):
        dtype = q.get("bnb_4bit_compute_dtype", "float32")
        return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).replace("torch.", ""))
    return base.config.dtype if isinstance(base.config.dtype, torch.dtype) else getattr(torch, str(base.config.dtype))


def _merged_entry(key: str, weight: torch.Tensor, layer, adapter: str, quantized=None,
                  plain: torch.dtype | None = None) -> models.Entry:
    """One tensor of the merged export: base + LoRA delta where `layer` (a LoRA layer) wraps it;
    a quantized base's weight (`quantized`: its bitsandbytes layer) dequantized first; every
    floating tensor of a quantized base in `plain`, its compute dtype."""
    entry = models._tensor_entry(key, weight)
    if layer is None and plain is None:
        return entry
    gathered = [p for p in layer.parameters() if models.is_partitioned(p)] if layer is not None else []
    dtype = plain or entry.dtype
    shape = tuple(quantized.weight.quant_state.shape) if hasattr(getattr(quantized, "weight", None), "quant_state") \
        and quantized.weight.quant_state is not None else entry.shape

    def make() -> torch.Tensor:
        base = _dequantized(quantized) if quantized is not None else weight.detach()
        if layer is not None:
            base = base.to(dtype) + layer.get_delta_weight(adapter).to(dtype)
        return base.to(dtype) if base.is_floating_point() else base

    return models.Entry(key, gathered, make, shape, dtype if entry.dtype.is_floating_point or quantized is not None else entry.dtype)


def _dequantized(layer) -> torch.Tensor:
    """A bitsandbytes layer's weight as a float tensor (peft's own dequantization, what its merge uses)."""
    from peft.utils.integrations import dequantize_bnb_weight
    return dequantize_bnb_weight(layer.weight, state=getattr(layer, "state", None)).detach()
