"""Whether the datasets that `eval.lm_eval_tasks` entries use are there offline (called by
contract.lm_eval_names.task_problems when runs cannot download: an entry whose data is missing
used to end the run at its first evaluation, the harness failing to download it).

What an entry uses: a task's YAML (and the files it includes) names `dataset_path`, maybe
`dataset_name` and `dataset_kwargs.data_files`; a group lists its tasks (names, or inline task
configs); a tag is carried by the tasks that name it. Names are looked up in the installed
harness's index (`lm_eval.tasks.TaskManager().task_index`, some seconds to build: what a name
uses is kept in a file beside the names, one per harness version). A hub dataset is available
when `datasets.load_dataset_builder` finds it in the cache with the hub switched off; local data
files and folders when they exist. Torch-free (the datasets library does not import torch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MAX_LISTED = 3  # datasets named in one message; the rest counted


@dataclass(frozen=True)
class Data:
    """One dataset a task loads."""
    path: str
    name: str | None = None
    files: tuple[str, ...] = ()

    def label(self) -> str:
        return f"{self.path} ({self.name})" if self.name else self.path


def missing_data(entries: list[str], cache_file: Path) -> list[str]:
    """One message per entry (a known name or an existing YAML file) whose datasets are not all
    available offline, naming the entry, the datasets and what to do. `cache_file`: where what
    each name uses is kept (per harness version)."""
    messages = []
    cache = _Cache(cache_file)
    for entry in entries:
        try:
            used = cache.get(entry) if not entry.endswith((".yaml", ".yml")) else _of_yaml(Path(entry))
        except Exception as e:  # noqa: BLE001 - a YAML the harness would fail on too: say which
            messages.append(f"{entry!r}: its task configuration could not be read ({type(e).__name__}: {e})")
            continue
        gone = [d for d in dict.fromkeys(used) if not available(d)]
        if gone:
            shown = ", ".join(d.label() for d in gone[:MAX_LISTED])
            more = f" and {len(gone) - MAX_LISTED} more" if len(gone) > MAX_LISTED else ""
            messages.append(
                f"{entry!r} needs the dataset{'s' if len(gone) > 1 else ''} {shown}{more}, not in the Hugging "
                f"Face cache, and runs are offline: download it once online (python -c \"import datasets; datasets.load_dataset("
                f"'{gone[0].path}'{', ' + repr(gone[0].name) if gone[0].name else ''})\"), or let the run "
                "download it (HF_HUB_OFFLINE=0)")
    cache.save()
    return messages


def available(data: Data) -> bool:
    """Whether the harness can load `data` without the network."""
    if data.files:
        return all(Path(f).expanduser().exists() for f in data.files if "://" not in f) and \
            not any("://" in f for f in data.files)
    if Path(data.path).expanduser().exists():
        return True
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read by datasets when imported: the cache only
    import datasets
    datasets.config.HF_HUB_OFFLINE = True  # and when it was imported before
    try:
        datasets.load_dataset_builder(data.path, data.name)
    except Exception:  # noqa: BLE001 - not in the cache (ConnectionError), or not loadable offline
        return False
    return True


# -- what an entry uses -----------------------------------------------------------------------

def _of_config(cfg: dict[str, Any], seen: set[str]) -> list[Data]:
    if cfg.get("dataset_path"):
        files = (cfg.get("dataset_kwargs") or {}).get("data_files") or ()
        if isinstance(files, dict):
            files = [f for v in files.values() for f in (v if isinstance(v, list) else [v])]
        elif isinstance(files, str):
            files = [files]
        return [Data(str(cfg["dataset_path"]), cfg.get("dataset_name"), tuple(str(f) for f in files))]
    used: list[Data] = []
    members = cfg.get("task")
    for member in members if isinstance(members, list) else []:  # a group: its tasks
        if isinstance(member, str):
            used += _of_name(member, seen)
        elif isinstance(member, dict):
            used += _of_config(member, seen) if member.get("dataset_path") or isinstance(member.get("task"), list) \
                else _of_name(str(member.get("task", "")), seen)
    return used


def _of_yaml(path: Path, seen: set[str] | None = None) -> list[Data]:
    return _of_config(_load(path), seen if seen is not None else set())


_INDEX: dict[str, Any] | None = None


def _index() -> dict[str, Any]:
    global _INDEX
    if _INDEX is None:
        from lm_eval.tasks import TaskManager  # torch-free; builds the index (some seconds)
        _INDEX = TaskManager().task_index
    return _INDEX


def _of_name(name: str, seen: set[str]) -> list[Data]:
    if name in seen:  # a group including itself through another: looked at once
        return []
    seen.add(name)
    index = _index()
    entry = index.get(name)
    if entry is None:
        return []
    path = getattr(entry, "yaml_path", None)
    if path is not None:
        return _of_yaml(Path(path), seen)
    tagged = [n for n, e in index.items() if name in (getattr(e, "tags", None) or ()) and n != name]
    return [d for n in tagged for d in _of_name(n, seen)]  # a tag; a task of Python only has none


class _SkipTags(yaml.SafeLoader):
    """The harness's YAML without running its `!function` tags (their values are not data)."""


_SkipTags.add_multi_constructor("!", lambda loader, suffix, node: None)


def _load(path: Path) -> dict[str, Any]:
    """A task YAML with its `include`s merged under it, as the harness reads it."""
    cfg = yaml.load(path.read_text(), Loader=_SkipTags)  # noqa: S506 - SafeLoader; tags dropped
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds no mapping")
    includes = cfg.pop("include", None)
    merged: dict[str, Any] = {}
    for include in includes if isinstance(includes, list) else [includes] if includes else []:
        merged.update(_load(path.parent / include if not Path(include).is_absolute() else Path(include)))
    return {**merged, **cfg}


class _Cache:
    """What each task name uses, kept per harness version beside the names' index."""

    def __init__(self, file: Path) -> None:
        self.file = file
        try:
            self.known = {k: [Data(p, n, tuple(f)) for p, n, f in v] for k, v in json.loads(self.file.read_text()).items()}
        except (OSError, ValueError, TypeError):
            self.known = {}
        self.changed = False

    def get(self, name: str) -> list[Data]:
        if name not in self.known:
            self.known[name] = _of_name(name, set())
            self.changed = True
        return self.known[name]

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({k: [[d.path, d.name, list(d.files)] for d in v] for k, v in self.known.items()}))
            tmp.replace(self.file)
        except OSError:
            pass  # a read-only home: looked up again next time
