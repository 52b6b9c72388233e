"""A cache of tokenized datasets: a file source encoded once, read back by every later run.

Every rank of every run used to read, check and tokenize its whole training file (the default
task: 50,000 rows, ~5 s of CPU per rank). `cached_dataset` keeps what `build_dataset` returns
for a file under the livetune cache folder ($LIVETUNE_CACHE, else ~/.cache/livetune, beside the
default task's assets), in `data-v1/<key>.npz`, and reads it back (~0.4 s) when nothing that
changes the encoding changed. The key is a hash of:

* the source: its path as given, size, modification time (ns) and inode (a folder saved by
  `datasets`: each file's); rewriting or replacing the file changes it;
* the tokenizer: its backend's JSON (vocabulary, normalizer, the post-processor that adds bos,
  added tokens), special tokens and their ids, chat template, length and class;
* the settings: data format, max_length, overlong;
* the code: CACHE_VERSION, the source text of the modules that read and encode rows, and the
  versions of transformers, tokenizers and jinja2 (chat templates).

Why the shared cache and not the run folder: the runs that pay the cost are new runs of the same
data (every Start of the default task, each test launch), which share no run folder. A cache
entry is a pure function of its key, so sharing it is safe.

Rules. An entry is written only for data that encoded cleanly (no dropped row): a file with bad
rows is encoded again each time, so its rows are named by number exactly as the first time;
a DataError (overlong rows under overlong="error", no usable row) is raised before anything is
written. Entries are written to a temporary file and renamed into place (readers see all of one
or nothing). While one process builds an entry it holds a lock on `<key>.lock` (flock): the other
ranks of the run wait for it and read the entry instead of each tokenizing the same file; if the
builder fails, the lock is released and the next one builds (and fails) itself. An entry that
cannot be read back (truncated, corrupt, another layout) is rebuilt, never fatal; a cache folder
that cannot be written only costs the time. LIVETUNE_DATA_CACHE=0 turns the cache off.

Payload (numpy's .npz, no pickle): each sample field that holds token lists as one flat int32
(or int64) array and its offsets, a scalar field (KTO's label) as an array; the kept row numbers;
a JSON header with the key, the field names in order and the data report. Read back, the samples
are the same Python lists of ints as a fresh build's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from contract.data_rows import PREFERENCE_FORMATS
from engine.data.dataset import TokenizedDataset, build_dataset
from engine.data.default_task import cache_base
from engine.data.file_lock import held
from engine.data.preference import PreferenceDataset
from engine.data.report import DataReport

CACHE_VERSION = 1  # bump when the payload's layout changes
FOLDER = "data-v1"
# the modules whose code decides the encoded rows: a change to any of them is a new key
ENCODING_MODULES = ("engine.data.dataset", "engine.data.formats", "engine.data.chat",
                    "engine.data.preference", "contract.data_rows", "contract.data_files")
LIBRARIES = ("transformers", "tokenizers", "jinja2")

Built = tuple[Any, DataReport]


def enabled() -> bool:
    """Whether tokenized datasets are cached (LIVETUNE_DATA_CACHE=0 turns it off)."""
    return os.environ.get("LIVETUNE_DATA_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cached_dataset(source, tokenizer, *, format: str = "auto", max_length: int = 512,
                   overlong: str = "truncate", root: Path | None = None,
                   build: Callable[..., Built] = build_dataset) -> Built:
    """`build_dataset(source, tokenizer, format=, max_length=, overlong=)`, read from the cache
    when an entry for the same file, tokenizer, settings and code exists (see the module
    docstring), else built and, when every row encoded cleanly, stored. Sources that are not a
    file or folder on disk (rows in memory), and tokenizers without a backend JSON, are built
    every time. `root`: the cache folder (default: `cache_base() / FOLDER`)."""
    settings = {"format": format, "max_length": max_length, "overlong": overlong}
    key = entry_key(source, tokenizer, settings) if enabled() else None
    if key is None:
        return build(source, tokenizer, **settings)
    folder = Path(root) if root is not None else cache_base() / FOLDER
    path = folder / f"{key}.npz"
    hit = read_entry(path, key)
    if hit is not None:
        return hit
    with held(folder / f"{key}.lock"):
        hit = read_entry(path, key)  # another process may have built it while this one waited
        if hit is not None:
            return hit
        dataset, report = build(source, tokenizer, **settings)
        if report.dropped == 0:
            write_entry(path, key, dataset, report)
    return dataset, report


# -- the key ------------------------------------------------------------------------------------

def entry_key(source, tokenizer, settings: dict) -> str | None:
    """The hash naming a cache entry, or None when `source` or `tokenizer` cannot be keyed."""
    identity = source_identity(source)
    tok = tokenizer_fingerprint(tokenizer)
    if identity is None or tok is None:
        return None
    parts = {"version": CACHE_VERSION, "code": _code_digest(), "source": identity,
             "tokenizer": tok, "settings": settings}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:40]


def source_identity(source) -> list | None:
    """(path as given, and size, mtime_ns, inode of it or of each file under it), or None for
    rows given in memory or a path that does not exist (build_dataset then says what is wrong)."""
    if not isinstance(source, (str, Path)):
        return None
    path = Path(source)
    try:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            return [str(path), [[str(p.relative_to(path)), *_stat(p)] for p in files]]
        return [str(path), _stat(path)]
    except OSError:
        return None


def _stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A hash of everything about `tokenizer` that the encoding reads; None when it has no
    backend JSON to hash (such a tokenizer's datasets are not cached)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    h = hashlib.sha256(backend.to_str().encode())
    extra = {"class": type(tokenizer).__name__, "len": len(tokenizer),
             "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
             "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
             "chat_template": getattr(tokenizer, "chat_template", None)}
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


_CODE_DIGEST: list[str] = []  # computed once per process


def _code_digest() -> str:
    """A hash of the encoding modules' source text and the libraries' versions."""
    if not _CODE_DIGEST:
        from importlib import import_module
        from importlib.metadata import PackageNotFoundError, version
        h = hashlib.sha256()
        for name in ENCODING_MODULES:
            h.update(Path(import_module(name).__file__ or "").read_bytes())
        for lib in LIBRARIES:
            with contextlib.suppress(PackageNotFoundError):
                h.update(f"{lib}={version(lib)}".encode())
        _CODE_DIGEST.append(h.hexdigest())
    return _CODE_DIGEST[0]


# -- the entry ----------------------------------------------------------------------------------

def write_entry(path: Path, key: str, dataset, report: DataReport) -> bool:
    """Store `dataset` and `report` at `path` atomically; False (nothing written) when the samples
    hold something other than token lists and int / bool scalars, or the folder cannot be written."""
    arrays = _encode_samples(dataset.samples)
    if arrays is None:
        return False
    header = {"key": key, "fields": list(dataset.samples[0]), "samples": len(dataset.samples),
              "report": _report_fields(report)}
    arrays["rows"] = np.asarray(dataset.rows, dtype=np.int64)
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)  # readers see the whole entry or none
        return True
    except OSError as e:  # a read-only or full cache folder: the run goes on uncached
        print(f"livetune: could not write the data cache entry {path}: {e}", file=sys.stderr)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def read_entry(path: Path, key: str) -> Built | None:
    """(dataset, report) stored at `path` for `key`, or None when there is none or it cannot be
    read back whole (it is then rebuilt and replaced)."""
    if not path.is_file():
        return None
    collecting = gc.isenabled()
    gc.disable()  # a million small lists made at once: the cycle collector would walk them all, repeatedly
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(z["header"].tobytes())
            if header.get("key") != key:
                return None
            samples = _decode_samples(z, header["fields"], header["samples"])
            rows = z["rows"].tolist()
        report = _report_of(header["report"])
    except Exception as e:  # noqa: BLE001 - any damage (truncated zip, bad JSON, missing array) means rebuild
        print(f"livetune: the data cache entry {path} is unreadable ({type(e).__name__}: {e}); "
              "encoding the data again", file=sys.stderr)
        return None
    finally:
        if collecting:
            gc.enable()
    if len(rows) != len(samples) or report.rows_kept != len(samples):
        return None
    kind = PreferenceDataset if report.format in PREFERENCE_FORMATS else TokenizedDataset
    return kind(samples, rows), report


def _encode_samples(samples: list[dict]) -> dict[str, np.ndarray] | None:
    """Each field of the samples as arrays: token lists flat with their offsets, scalars as one array."""
    if not samples:
        return None
    fields = list(samples[0])
    if any(list(s) != fields for s in samples):
        return None
    arrays: dict[str, np.ndarray] = {}
    for i, name in enumerate(fields):
        values = [s[name] for s in samples]
        if all(isinstance(v, list) for v in values):
            lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
            flat = np.fromiter(itertools.chain.from_iterable(values), dtype=np.int64, count=int(lengths.sum()))
            small = flat.size == 0 or (flat.min() >= np.iinfo(np.int32).min and flat.max() <= np.iinfo(np.int32).max)
            arrays[f"f{i}_flat"] = flat.astype(np.int32) if small else flat
            arrays[f"f{i}_offsets"] = np.concatenate(([0], np.cumsum(lengths)))
        elif all(type(v) is bool for v in values):
            arrays[f"f{i}_scalar"] = np.asarray(values, dtype=np.bool_)
        elif all(type(v) is int for v in values):
            arrays[f"f{i}_scalar"] = np.asarray(values, dtype=np.int64)
        else:
            return None
    return arrays


def _decode_samples(z, fields: list[str], count: int) -> list[dict]:
    columns = []
    for i, _ in enumerate(fields):
        if f"f{i}_scalar" in z.files:
            column = z[f"f{i}_scalar"].tolist()
        else:
            flat, offsets = z[f"f{i}_flat"].tolist(), z[f"f{i}_offsets"].tolist()
            column = [flat[a:b] for a, b in zip(offsets, offsets[1:])]
        if len(column) != count:
            raise ValueError(f"field {fields[i]!r} holds {len(column)} samples, the header says {count}")
        columns.append(column)
    return [dict(zip(fields, values)) for values in zip(*columns)]


def _report_fields(report: DataReport) -> dict:
    fields = dataclasses.asdict(report)
    fields.pop("problems")  # no dropped row in a stored entry
    fields.pop("drop_reasons")
    return fields


def _report_of(fields: dict) -> DataReport:
    return DataReport(**fields)
