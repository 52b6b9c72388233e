"""The lm-evaluation-harness's task names, torch-free, for the pre-flight check and the forms:
`eval.lm_eval_tasks` entries are task / group / tag names the installed harness knows, or task
YAML files that exist. An unknown name used to end the run at its first evaluation.

`lm_eval.tasks.TaskManager` imports without torch (checked by tests/test_preflight.py), so the
names are the harness's own index, read in this process. Building that index reads every task
YAML the harness ships (about 14,000 files, some seconds): the names are kept in memory and in a
file beside the other caches ($LIVETUNE_CACHE, else ~/.cache/livetune), one per harness version.
Offline (runs are, unless HF_HUB_OFFLINE=0: supervisor.launch), each entry's datasets must be in
the Hugging Face cache, or the harness fails at the first evaluation trying to download them: a
task's YAML (and its includes) names its `dataset_path` / `dataset_name`, a group lists its tasks,
a tag is carried by its tasks; each hub dataset is looked up with `datasets.load_dataset_builder`
in offline mode (it reads the cache only). Datasets of local files (`dataset_kwargs.data_files`,
a folder) are checked to exist. What an entry uses is kept in a file beside the names.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
from functools import lru_cache
from pathlib import Path

YAML_SUFFIXES = (".yaml", ".yml")


def _cache_file(version: str) -> Path:
    root = Path(os.environ.get("LIVETUNE_CACHE") or Path.home() / ".cache" / "livetune")
    return root / f"lm_eval-{version}-tasks.json"


@lru_cache(maxsize=1)
def task_names() -> tuple[str, ...] | None:
    """Every task, group and tag name of the installed harness, sorted; None without lm-eval."""
    if importlib.util.find_spec("lm_eval") is None:
        return None
    from importlib.metadata import version
    cache = _cache_file(version("lm_eval"))
    try:
        return tuple(json.loads(cache.read_text()))
    except (OSError, ValueError):
        pass
    from lm_eval.tasks import TaskManager  # torch-free (the harness's models are not imported)
    names = tuple(sorted(TaskManager().all_tasks))
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(names))
        tmp.replace(cache)
    except OSError:
        pass  # a read-only home: the index is built again next time
    return names


def is_yaml_path(entry: str) -> bool:
    """A task YAML file rather than a task name."""
    return entry.endswith(YAML_SUFFIXES)


def offline() -> bool:
    """Whether runs cannot download (the launcher keeps HF_HUB_OFFLINE=1 unless it is set to 0)."""
    return os.environ.get("HF_HUB_OFFLINE", "1").strip().lower() not in ("0", "false", "no", "off")


def task_problems(tasks: list[str], key: str = "eval.lm_eval_tasks") -> list[tuple[str, str]]:
    """(field, message) for each entry the harness would refuse at the first evaluation: a YAML
    file that does not exist, a name the installed harness does not know (with close names), and,
    offline, an entry whose datasets are not in the Hugging Face cache (lm_eval_data)."""
    problems: list[tuple[str, str]] = []
    names: tuple[str, ...] | None = None
    known: list[str] = []
    for entry in tasks:
        if is_yaml_path(entry):
            if not Path(entry).is_file():
                problems.append((key, f"no such task YAML file: {entry}"))
            else:
                known.append(entry)
            continue
        if names is None:
            names = task_names()
            if names is None:
                return [(key, "the lm-eval package is not installed: pip install lm-eval, or empty this list")]
        if entry not in names:
            close = difflib.get_close_matches(entry, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            problems.append((key, f"{entry!r} is not a task, group or tag of the installed lm-eval "
                             f"({len(names)} names) nor a task YAML file (.yaml){hint}"))
        else:
            known.append(entry)
    if known and offline():
        from importlib.metadata import PackageNotFoundError, version

        from contract.lm_eval_data import missing_data  # only when there is something to look up
        try:
            harness = version("lm_eval")
        except PackageNotFoundError:
            return problems + [(key, "the lm-eval package is not installed: pip install lm-eval, or empty this list")]
        data_cache = _cache_file(harness).with_name(f"lm_eval-{harness}-data.json")
        problems += [(key, message) for message in missing_data(known, data_cache)]
    return problems
