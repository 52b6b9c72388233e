"""Models in Hugging Face format: the engine's weights to and from a folder `from_pretrained` reads.

The primitives (`save_hf`, `model_entries`, `load_tensors` ...); which of them a run uses is
decided by its layout and method objects (engine.parallel.layouts, engine.model.methods), reached
through `engine.checkpoint.save_model` / `load_model`.

Saving streams: the tensors are cut into shards of at most `max_shard_size` bytes, and under
ZeRO-3 each tensor is gathered (deepspeed.zero.GatheredParameters), appended by rank 0 to its
shard's safetensors file (stream_safetensors.py) and released before the next one is gathered.
No rank ever holds more than its ZeRO share of the model plus one tensor, and only rank 0
writes. One shard: a single `model.safetensors`; several: `model-0000k-of-0000n.safetensors` and the index
`model.safetensors.index.json`, as transformers writes them. The model's config (with the saved
dtype), generation config and the tokenizer go alongside.

Loading reads that format (sharded or not, safetensors or `.bin`) into the running engine under
every ZeRO stage: every key and shape is checked before any weight changes; under ZeRO-3 only
rank 0 reads, shard by shard, and the parameters are re-partitioned from it. The optimizer's fp32
master copy is refreshed from the new weights.

Weights are read and written through `Entry` records (key, the parameters to gather, how to make
the tensor), so the LoRA merge in `adapters.py` writes through the same streaming writer.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from huggingface_hub.serialization._base import parse_size_to_int
from safetensors import safe_open

from engine.context import RunContext
from engine.parallel import ds_config
from engine.checkpoint import atomic
from engine.checkpoint.locations import CheckpointError
from engine.checkpoint.agreement import Comm
from engine.checkpoint.stream_safetensors import StreamedSafetensors
from contract.events import ExportEvent
from engine.checkpoint import locations
from engine.checkpoint import reading

SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_SINGLE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
DEFAULT_SHARD_SIZE = "5GB"  # transformers' default


class ModelLoadError(CheckpointError):
    """The folder's weights do not fit the engine's model (keys or shapes), or it has none."""


@dataclass
class Entry:
    """One tensor of the saved state dict: its key, the (possibly ZeRO-3 partitioned) parameters
    that must be gathered to make it, and `make()`, valid while they are gathered."""
    key: str
    params: list[torch.Tensor]
    make: Callable[[], torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


full_shape = ds_config.full_shape          # a tensor's real shape, ZeRO-3 partitioned or not
is_partitioned = ds_config.is_partitioned  # a ZeRO-3 parameter (its data is this rank's shard)


def _tensor_entry(key: str, t: torch.Tensor) -> Entry:
    return Entry(key, [t] if is_partitioned(t) else [], lambda: t.detach(), full_shape(t), t.dtype)


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (shared ones once) and persistent buffers: what state_dict would hold."""
    seen = set()
    for name, p in module.named_parameters():
        seen.add(id(p))
        yield name, p
    for mod_name, mod in module.named_modules():
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            yield (f"{mod_name}.{name}" if mod_name else name), b


def model_entries(module: torch.nn.Module) -> list[Entry]:
    return [_tensor_entry(k, t) for k, t in named_tensors(module)]


# -- writing ------------------------------------------------------------------------------------
def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return [s for s in shards if s]


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SAFE_SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_weights(entries: list[Entry], w: atomic.FolderWriter,
                  max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> dict:
    """Write `entries` as safetensors shards in `w.local` (rank 0; collective under ZeRO-3).
    Returns {"shards": n, "bytes": total, "largest_shard": bytes}.

    A write that fails (a full disk) is noted on the writer, not raised: rank 0 must still take
    part in every gather the other ranks wait in, and the save then fails alike on every rank
    when :func:`atomic.writing` ends."""
    comm = w.comm
    limit = parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    shards = plan_shards(entries, limit)
    names = shard_names(len(shards))
    weight_map = {}
    for shard, name in zip(shards, names):
        # Gathering a whole shard held it on every rank, with DeepSpeed's gather buffers, and
        # save_file copied it once more: about 3 shards per rank (bench_checkpoint).
        layout = [(e.key, e.shape, e.dtype) for e in shard]
        out = _noted(w, StreamedSafetensors, str(w.local / name), layout, {"format": "pt"}) if comm.rank == 0 else None
        for e in shard:
            with ds_config.gathered(e.params, modifier_rank=None):
                if out is not None and w.problem is None:
                    _noted(w, out.write, e.key, e.make())
        if out is not None:
            _noted(w, out.close)  # a shard cut short raises here, unless a failure is noted already
        weight_map.update({e.key: name for e in shard})
    total = sum(e.nbytes for e in entries)
    if comm.rank == 0 and len(shards) > 1 and w.problem is None:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _noted(w, (w.local / SAFE_INDEX).write_text, json.dumps(index, indent=2, sort_keys=True))
    largest = max((sum(e.nbytes for e in s) for s in shards), default=0)
    return {"shards": len(shards), "bytes": total, "largest_shard": largest}


def _noted(w: atomic.FolderWriter, call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)`, with a failure noted on `w` (the first counts) instead of raised."""
    try:
        return call(*args)
    except Exception as e:  # noqa: BLE001 - raised at the writer's agreement, on every rank
        w.fail(e)
        return None


def write_model_files(folder: Path, hf_model, tokenizer, dtype: torch.dtype) -> None:
    """Config (saying the saved dtype), generation config and tokenizer: rank 0 only."""
    config = copy.deepcopy(hf_model.config)
    config.dtype = str(dtype).split(".")[1]
    if getattr(config, "quantization_config", None) is not None:
        # what is written here is never quantized (the merged export of a quantized base dequantizes)
        del config.quantization_config
    config.save_pretrained(str(folder))
    generation = getattr(hf_model, "generation_config", None)
    if generation is not None:
        try:
            generation.save_pretrained(str(folder))
        except ValueError:  # an invalid generation config must not cost the weights
            pass
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))


def save_hf(run: RunContext, path: str, hf_model: torch.nn.Module, entries: list[Entry],
            max_shard_size: int | str, kind: str = "model") -> dict:
    """Publish a Hugging Face model folder at `path` atomically (every rank calls this)."""
    started = time.perf_counter()
    comm = Comm.current()
    dtype = entries[0].dtype if entries else torch.float32
    meta = {"step": run.state.global_step}
    with atomic.writing(path, kind=kind, meta=meta, comm=comm) as w:
        info = write_weights(entries, w, max_shard_size)
        if comm.rank == 0:
            write_model_files(w.local, hf_model, run.tokenizer, dtype)
    info["seconds"] = time.perf_counter() - started
    run.emit(ExportEvent(kind=kind, path=str(path), step=run.state.global_step, **info))
    return info


# -- reading ------------------------------------------------------------------------------------
class WeightReader:
    """The tensors of a Hugging Face folder, read lazily one at a time."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._open_name, self._open = None, None
        self.weight_map = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        for index_name in (SAFE_INDEX, BIN_INDEX):
            index = self.folder / index_name
            if index.is_file():
                try:
                    return json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise ModelLoadError(f"{index} is not a valid weight index: {e}") from None
        for single in (SAFE_SINGLE, BIN_SINGLE):
            if (self.folder / single).is_file():
                return {k: single for k in self._file(single).keys()}
        raise ModelLoadError(f"{self.folder} holds no weights: expected {SAFE_SINGLE}, {SAFE_INDEX}, "
                             f"{BIN_SINGLE} or {BIN_INDEX}")

    def _file(self, name: str):
        if self._open_name != name:
            path = self.folder / name
            if not path.is_file():
                raise ModelLoadError(f"{path} is missing (the index names it)")
            try:
                if name.endswith(".safetensors"):
                    self._open = safe_open(str(path), framework="pt", device="cpu")
                else:
                    self._open = _BinFile(torch.load(str(path), map_location="cpu", mmap=True, weights_only=True))
            except Exception as e:  # noqa: BLE001 - any parse failure is a damaged file
                raise ModelLoadError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
            self._open_name = name
        return self._open

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file(self.weight_map[key]).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._file(self.weight_map[key]).get_tensor(key)


class _BinFile:
    """The safe_open interface over a torch.load'ed (memory-mapped) state dict."""

    def __init__(self, state: dict):
        self.state = state

    def keys(self):
        return self.state.keys()

    def get_slice(self, key: str):
        return _Shape(self.state[key].shape)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.state[key]


@dataclass
class _Shape:
    shape: tuple

    def get_shape(self):
        return list(self.shape)


def tensor_aliases(module: torch.nn.Module, rename: Callable[[str], str] = lambda k: k) -> dict[str, str]:
    """Other names of shared tensors (a tied lm_head.weight) -> the name `named_tensors` uses."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[rename(name)] = rename(first[id(p)])
        else:
            first[id(p)] = name
    return aliases


def plan_load(reader: WeightReader, targets: dict[str, torch.Tensor], aliases: dict[str, str],
              where: str) -> dict[str, str]:
    """{engine key: file key} covering every engine tensor with a same-shaped one, or one error
    naming every missing, unexpected and misshapen key."""
    keys = set(reader.keys())
    source = {k: k for k in targets if k in keys}
    for alias, canonical in aliases.items():  # a tied tensor saved under its other name
        if alias in keys and canonical not in source:
            source[canonical] = alias
    missing = sorted(k for k in targets if k not in source)
    unexpected = sorted(keys - set(targets) - set(aliases))
    wrong = [f"{k}: file {reader.shape(f)}, model {full_shape(targets[k])}"
             for k, f in source.items() if reader.shape(f) != full_shape(targets[k])]
    problems = []
    if missing:
        problems.append(f"missing from the folder: {_few(missing)}")
    if unexpected:
        problems.append(f"not in the model: {_few(unexpected)}")
    if wrong:
        problems.append(f"shapes differ: {_few(wrong)}")
    if problems:
        raise ModelLoadError(f"the weights in {where} do not fit this model ({'; '.join(problems)}); "
                             "nothing was loaded")
    return source


def _few(items: list[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def load_into(engine, targets: dict[str, torch.Tensor], source: dict[str, str], reader: WeightReader,
              comm: Comm, max_bytes: int) -> None:
    """Copy the folder's tensors (`source`: engine key -> file key) into the engine; collective."""
    entries = [_tensor_entry(k, targets[k]) for k in source]
    with torch.no_grad():
        for shard in plan_shards(entries, max_bytes):
            params = [p for e in shard for p in e.params]
            with ds_config.gathered(params, modifier_rank=0):
                for e in shard:
                    if not e.params or comm.rank == 0:  # partitioned: rank 0 reads, the rest receive
                        targets[e.key].data.copy_(reader.get(source[e.key]).view(full_shape(targets[e.key])))
    ds_config.refresh_master_weights(engine)


def fetch_model_folder(path: str, comm: Comm) -> tuple[Path, bool]:
    """A local copy of a model folder (the folder itself when local); it must exist."""
    folder = locations.location(path)
    if not folder.exists():
        raise locations.CheckpointNotFoundError(f"no model folder at {folder.url}")
    if folder.is_local:
        return Path(folder.path), False
    base = folder.path.rstrip("/") + "/"
    rels = [p[len(base):] for p in folder.fs.find(folder.path) if p.startswith(base)]
    return reading.fetch(folder, rels)


def load_tensors(run: RunContext, path: str, targets: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """The weights of a Hugging Face folder (local or fsspec URL) into the engine's tensors
    `targets` (key -> tensor; `aliases`: other names of tied ones); collective. Every key and
    shape is checked before any weight changes."""
    comm = Comm.current()
    local, temporary = fetch_model_folder(path, comm)
    try:
        load_local(run, local, str(path), targets, aliases, comm)
    finally:
        if temporary:
            shutil.rmtree(local, ignore_errors=True)


def load_local(run: RunContext, local: Path, url: str, targets: dict[str, torch.Tensor], aliases: dict[str, str],
               comm: Comm) -> None:
    """`load_tensors` from a local copy of the folder (`url`: where it came from, for messages)."""
    verify_if_marked(local, url, comm)
    reader = WeightReader(local)
    source = plan_load(reader, targets, aliases, url)
    load_into(run.engine, targets, source, reader, comm, parse_size_to_int(DEFAULT_SHARD_SIZE))


def verify_if_marked(local: Path, url: str, comm: Comm) -> None:
    """A folder we wrote carries a manifest: check it (each rank a share of the files)."""
    marker = reading.read_marker(locations.location(str(local)))
    if marker is None:
        return
    files = sorted(marker.get("files", {}))
    mine = files[comm.rank::comm.world]
    problems = comm.agree("; ".join(reading.verify(locations.location(str(local)), marker, mine)) or None)
    if problems:
        raise locations.CorruptCheckpointError(f"{url} is damaged: {'; '.join(problems)}; nothing was loaded")
