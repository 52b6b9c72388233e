"""A model named by its Hugging Face hub ID (`Qwen/Qwen2.5-0.5B`) instead of a local folder.

`model.path` (and `model.tokenizer`) may be a hub ID. A local folder of that name wins, as in
transformers. Otherwise the model is read from the Hugging Face cache (HF_HOME / HF_HUB_CACHE,
the same cache transformers and `huggingface-cli download` fill): the run's ranks load the
snapshot folder through the same code that loads any local model folder. When the cache lacks it
and the network is allowed, every rank calls `snapshot_download` at start (huggingface_hub's
file locks let one download while the others wait; its progress goes to the rank logs). With
HF_HUB_OFFLINE=1 an ID missing from the cache is refused before any rank starts, saying so.

Torch-free: the pre-flight check and the config's validation use it, and so does the engine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# "owner/name", as the hub spells repository IDs (no leading ".", "/" or "~": those are paths)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# what a causal LM needs; other weight formats (TF, Flax, ONNX, GGUF, originals) are skipped
_SKIPPED = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "*.gguf", "*.pth", "original/*", "onnx/*"]


class HubModelMissing(FileNotFoundError):
    """A hub ID that is neither a local folder nor in the cache, where nothing may be downloaded."""


def is_hub_id(value: str) -> bool:
    """`value` names a hub repository, not a local path (a local folder of that name wins)."""
    return bool(value) and _HUB_ID.match(value) is not None and not Path(value).expanduser().exists()


def offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def cache_dir() -> str:
    from huggingface_hub import constants
    return str(constants.HF_HUB_CACHE)


def cached_folder(repo_id: str) -> Path | None:
    """The snapshot folder of `repo_id` in the cache, or None when the cache does not hold it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def known_folder(path: str) -> Path:
    """The local folder `path` means as far as can be told without a download: itself, or a hub
    ID's snapshot in the cache (else the path as given, which does not exist)."""
    return (cached_folder(path) or Path(path)) if is_hub_id(path) else Path(path)


# the variables huggingface_hub reads the cache's place from, the first one set winning
# (HUGGINGFACE_HUB_CACHE is its older name of HF_HUB_CACHE; HF_HOME holds the cache in hub/)
_CACHE_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME")


def cache_hint() -> str:
    """How to point at another cache, naming the variable that placed this one (the one the user
    set), or both usual ones when none is set."""
    for name in _CACHE_VARIABLES:
        if os.environ.get(name):
            where = "a folder whose hub/ subfolder holds it" if name == "HF_HOME" else "a cache that holds it"
            return f"point {name} (set to {os.environ[name]}) at {where}"
    return "point HF_HUB_CACHE at a cache that holds it (or HF_HOME at a folder whose hub/ holds it)"


def missing_message(repo_id: str) -> str:
    return (f"{repo_id} is not a local folder, and the Hugging Face cache ({cache_dir()}) does not "
            "hold it; HF_HUB_OFFLINE=1 forbids downloading it. Download it where there is network "
            f"(huggingface-cli download {repo_id}), {cache_hint()}, or name a local model folder")


def local_folder(path: str) -> Path:
    """The local folder `path` means: itself, or a hub ID's snapshot in the cache (downloaded
    first when it is missing and the network is allowed). Raises HubModelMissing offline."""
    if not is_hub_id(path):
        return Path(path)
    folder = cached_folder(path)
    if folder is not None:
        return folder
    if offline():
        raise HubModelMissing(missing_message(path))
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(path, ignore_patterns=_SKIPPED))
