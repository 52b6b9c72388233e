"""A run folder as a tree of branches. Torch-free: the engine writes it, front ends read it.

    <run>/branches.json                 the tree: each branch's parent, fork step and source
    <run>/checkpoints/                  the root branch's ("main") checkpoints
    <run>/branches/<name>/checkpoints/  each other branch's own checkpoints

A run starts on "main". `branch` (contract.protocol.Branch) rewinds to a checkpoint or snapshot
and goes on as a new branch; the branch it leaves keeps its checkpoints and can be branched from
(or resumed, `resume=<branch>`) later.

Events stay in the one append-only events.jsonl (every front end tails it; nothing is ever
rewritten). An event belongs to the branch its `branch` field names; one without the field (the
supervisor's, and everything before the first branch) belongs to the branch that was current at
its line: "main" at first, then the branch the last `branch` event (or a `resume` event with a
`branch` field) switched to. From that:

- `branch_events(events, name)`: a branch's own history, alone;
- `path_events(events, name, tree)`: its history as the path from the root: each ancestor's
  events up to the fork, then its own, without the steps a `rewind` (or the fork) abandoned.

A `rewind` event records `step` (where training goes on from) and `abandoned` ([first, last]
steps given up), so a plot can grey or dash that part.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

ROOT = "main"
TREE_FILE = "branches.json"
MAX_NAME = 64
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_name(name: str, what: str = "branch") -> str:
    """`name` if it is a usable branch / snapshot name, else ValueError naming the rule."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_NAME or ".." in name:
        raise ValueError(f"{what} name {name!r} is not allowed: use 1-{MAX_NAME} letters, digits, "
                         "'-', '_' or '.', starting with a letter or digit")
    return name


@dataclass
class BranchInfo:
    """One branch: where it forked from (None for the root)."""
    name: str
    parent: str | None = None
    fork_step: int = 0
    source: str = ""            # the checkpoint URL or "snapshot:<name>" it started from
    created: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)  # settings changed by the branch command


@dataclass
class BranchTree:
    """The branches of one run folder and the one training goes on in (`current`)."""
    branches: dict[str, BranchInfo] = field(default_factory=lambda: {ROOT: BranchInfo(ROOT)})
    current: str = ROOT

    # -- reading and writing ----------------------------------------------------------------
    @classmethod
    def load(cls, run_root: Path | str) -> "BranchTree":
        """The tree of the run folder `run_root` (a single "main" branch when none was written)."""
        path = Path(run_root) / TREE_FILE
        if not path.exists():
            return cls()
        raw = json.loads(path.read_text())
        infos = {n: BranchInfo(**{k: v for k, v in b.items() if k in BranchInfo.__dataclass_fields__})
                 for n, b in raw.get("branches", {}).items()}
        return cls(branches=infos or {ROOT: BranchInfo(ROOT)}, current=raw.get("current", ROOT))

    def save(self, run_root: Path | str) -> None:
        """Write branches.json atomically (rank 0 only)."""
        path = Path(run_root) / TREE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)

    def to_dict(self) -> dict[str, Any]:
        return {"current": self.current, "branches": {n: asdict(b) for n, b in self.branches.items()}}

    # -- changing it --------------------------------------------------------------------------
    def add(self, name: str, parent: str, fork_step: int, source: str,
            settings: dict[str, Any] | None = None) -> BranchInfo:
        """A new branch of `parent` (ValueError when the name is taken or the parent unknown)."""
        check_name(name, "branch")
        if name in self.branches:
            raise ValueError(f"branch {name!r} exists already (branches: {', '.join(self.branches)})")
        self.require(parent)
        info = BranchInfo(name, parent, int(fork_step), source, time.time(), dict(settings or {}))
        self.branches[name] = info
        return info

    def require(self, name: str) -> BranchInfo:
        if name not in self.branches:
            raise ValueError(f"no branch named {name!r}; this run has {', '.join(self.branches)}")
        return self.branches[name]

    # -- reading it -----------------------------------------------------------------------------
    def ancestry(self, name: str) -> list[str]:
        """The branches from the root down to `name`."""
        chain = [self.require(name).name]
        while self.branches[chain[-1]].parent is not None:
            chain.append(self.branches[chain[-1]].parent)  # type: ignore[arg-type]
        return chain[::-1]

    def fork_sources(self) -> set[str]:
        """The checkpoint URLs branches start from (the keep rules never delete them)."""
        return {b.source for b in self.branches.values() if b.source and not b.source.startswith("snapshot:")}

    def children(self, name: str) -> list[str]:
        return [b.name for b in self.branches.values() if b.parent == name]


def checkpoints_dir(run_root: Path | str, branch: str) -> Path:
    """Where branch `branch` keeps its training checkpoints."""
    root = Path(run_root)
    return root / "checkpoints" if branch == ROOT else root / "branches" / branch / "checkpoints"


# -- events by branch ----------------------------------------------------------------------------
def attributed(events: Iterable[dict]) -> Iterable[tuple[str, dict]]:
    """(branch, event) for each event, by the rule in the module docstring."""
    current = ROOT
    for event in events:
        kind, named = event.get("type"), event.get("branch")
        if isinstance(named, str) and kind in ("branch", "resume"):
            current = named
        yield (named if isinstance(named, str) else current), event


def branch_events(events: Iterable[dict], name: str) -> list[dict]:
    """The events of branch `name` alone."""
    return [e for b, e in attributed(events) if b == name]


def path_events(events: Iterable[dict], name: str, tree: BranchTree) -> list[dict]:
    """Branch `name`'s history from the root: ancestors up to each fork, then its own events;
    steps a rewind (or a fork) abandoned are left out."""
    chain = tree.ancestry(name)
    out: list[dict] = []
    left: set[str] = set()  # ancestors the chain has forked away from
    for branch, event in attributed(events):
        kind = event.get("type")
        if kind == "branch" and branch in chain and event.get("parent") in chain:
            left.add(event["parent"])
            _drop_after(out, event.get("step"))
        if branch not in chain or (branch in left and kind != "branch"):
            continue
        if kind == "rewind":
            _drop_after(out, event.get("step"))
        out.append(event)
    return out


def _drop_after(out: list[dict], step: Any) -> None:
    if not isinstance(step, int):
        return
    out[:] = [e for e in out if not (e.get("type") in ("train", "eval") and isinstance(e.get("step"), int)
                                     and e["step"] > step)]


# -- resume=<branch> --------------------------------------------------------------------------------
def names_branch(value: str) -> bool:
    """Whether a `resume=` value is a branch name rather than a path: a valid name that is no
    existing file or folder (a path wins; `latest` is its own word)."""
    if not value or value == "latest" or "://" in value or os.sep in value:
        return False
    try:
        check_name(value)
    except ValueError:
        return False
    return not Path(value).exists()


def resume_problem(output_dir: str, run_name: str, branch: str) -> str | None:
    """Why `resume=<branch>` cannot work (None when it can, or when the run folder is not there
    yet to tell)."""
    if not run_name:
        return (f"{branch!r} is no checkpoint folder; to resume a branch, name its run with "
                "logging.run_name (run_name=...)")
    root = Path(output_dir) / run_name
    if not (root / "events.jsonl").exists():
        return f"no such checkpoint folder, and no run {run_name!r} in {output_dir} whose branch it could be"
    tree = BranchTree.load(root)
    if branch not in tree.branches:
        return f"no checkpoint folder {branch!r}, and run {run_name!r} has no such branch (it has {', '.join(tree.branches)})"
    return None
