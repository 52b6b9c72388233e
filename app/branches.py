"""A run's branches as the front ends show them: the tree, what can be rewound to
(every branch's checkpoints, the snapshots in memory), and the loss / lr / evaluation series of
every branch on one step axis, with the steps a rewind abandoned kept apart so a plot can grey
or dash them. Read from the run folder alone (branches.json, events.jsonl, the checkpoint
folders): it works for a run that has ended too. Torch-free, Gradio-free, ipywidgets-free.

    view = branch_view(RunFolder(path))
    view.tree.current, view.targets, view.series["loss"]["loss · main"]
    tree_lines(view)   # ["main (steps 1-60)", "└ lower-lr: from step-40 of main, lr 0.001 ◀ training"]

Series names are "KIND · BRANCH" (the Runs tab's overlay convention, one colour per branch);
an abandoned stretch is "KIND · BRANCH (abandoned N)", N counting from 1 per branch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from contract.branches import ROOT, BranchTree, attributed, checkpoints_dir
from contract.run_folder import RunFolder, read_events
from contract.protocol.states import RunState
from contract.events import (BranchEvent, EvalEvent, Event, RewindEvent, SnapshotEvent, StateEvent, TrainEvent,
                             as_event, metric_numbers)

Point = tuple[int, float]
ABANDONED = "abandoned"
SNAPSHOT_PREFIX = "snapshot:"  # how a rewind / branch target names a snapshot (engine.checkpoint.rewind)


@dataclass(frozen=True)
class Target:
    """Something a rewind or branch can start from: a complete checkpoint or a kept snapshot."""
    label: str     # as a list shows it: "step-40 (main)", "snapshot snap-12 (main, step 12)"
    value: str     # what the command's `target` takes: the checkpoint folder, or "snapshot:<name>"
    branch: str
    step: int | None
    kind: str      # "checkpoint" or "snapshot"


@dataclass
class BranchView:
    tree: BranchTree
    series: dict[str, dict[str, list[Point]]]   # plot ("loss", "lr", "eval") -> series -> points
    targets: list[Target]
    steps: dict[str, tuple[int, int]] = field(default_factory=dict)  # branch -> (first, last) step
    rewinds: list[RewindEvent | BranchEvent] = field(default_factory=list)  # every rewind / branch event


def branch_view(folder: RunFolder, events: Iterable[dict[str, Any]] | None = None) -> BranchView:
    """The tree, the targets and the overlaid series of the run in `folder` (`events`: its log's
    JSON objects, when already read)."""
    raw = read_events(folder.events) if events is None else events
    # each event parsed once, after contract.branches has told its branch (it reads the objects)
    parsed = [(branch, model) for branch, event in attributed(raw) if (model := as_event(event)) is not None]
    tree = BranchTree.load(folder.root)
    fold = _Fold()
    for branch, model in parsed:
        fold.take(branch, model)
    targets = checkpoint_targets(folder.root, tree) + snapshot_targets(model for _, model in parsed)
    return BranchView(tree, fold.series(), targets, fold.steps(), fold.rewinds)


def checkpoint_targets(root: Path, tree: BranchTree) -> list[Target]:
    """Every branch's complete training checkpoints, newest first within a branch."""
    found = []
    for name in tree.branches:
        folder = checkpoints_dir(root, name)
        steps = []
        for child in folder.glob("step-*") if folder.is_dir() else []:
            step = child.name[len("step-"):]
            if step.isdigit() and (child / "COMPLETE.json").exists():
                steps.append((int(step), child))
        for step, child in sorted(steps, reverse=True):
            found.append(Target(f"{child.name} ({name})", str(child), name, step, "checkpoint"))
    return found


def snapshot_targets(events: Iterable[Event | dict[str, Any]]) -> list[Target]:
    """The snapshots kept in host memory, as the last `snapshot` event lists them (they live as
    long as the run's processes: none once the run has ended). `events`: models, or read JSON
    objects (one that does not match its model is skipped)."""
    taken: dict[str, SnapshotEvent] = {}
    kept: list[str] = []
    ended = False
    for raw in events:
        event = as_event(raw)
        if isinstance(event, SnapshotEvent) and event.name is not None:
            taken[event.name] = event
            kept = list(event.kept) if event.kept is not None else [event.name]
        elif isinstance(event, StateEvent) and event.state in (RunState.FINISHED, RunState.FAILED):
            ended = True
        elif isinstance(event, StateEvent) and event.state == RunState.STARTING:
            ended, kept = False, []  # a resumed run starts with no snapshot
    if ended:
        return []
    out = []
    for name in reversed(kept):
        e = taken.get(name)
        step = e.step if e is not None else None
        branch = e.branch if e is not None and e.branch is not None else ROOT
        out.append(Target(f"snapshot {name} ({branch}, step {step})", SNAPSHOT_PREFIX + name, branch, step,
                          "snapshot"))
    return out


class _Fold:
    """Each branch's live points and its abandoned stretches, folded from the events in order."""

    def __init__(self) -> None:
        self.live: dict[str, dict[str, list[Point]]] = {}        # branch -> kind -> points
        self.gone: dict[str, list[dict[str, list[Point]]]] = {}  # branch -> abandoned stretches
        self.rewinds: list[RewindEvent | BranchEvent] = []

    def take(self, branch: str, event: Event) -> None:
        step = getattr(event, "step", None)  # not every event has one
        if step is None:
            return
        if isinstance(event, BranchEvent):
            self.rewinds.append(event)
            parent = event.parent
            # the new branch's lines start where it forked: the parent's point at that step
            for name, points in self.live.get(parent, {}).items() if parent is not None else ():
                at = [p for p in points if p[0] == step]
                if at:
                    self.live.setdefault(branch, {}).setdefault(name, []).append(at[-1])
        elif isinstance(event, RewindEvent):
            self.rewinds.append(event)
            self._abandon(branch, step)
        elif isinstance(event, TrainEvent):
            self._point(branch, step, {"loss": event.loss, "lr": event.lr})
        elif isinstance(event, EvalEvent):
            self._point(branch, step, {f"eval {k[5:]}": v for k, v in metric_numbers(event).items()})

    def _point(self, branch: str, step: int, values: dict[str, Any]) -> None:
        series = self.live.setdefault(branch, {})
        for name, value in values.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            points = series.setdefault(name, [])
            if points and points[-1][0] >= step:  # trained again without a rewind event (a resume)
                self._abandon(branch, step - 1, only=name)
                points = series.setdefault(name, [])
            points.append((step, float(value)))

    def _abandon(self, branch: str, step: int, only: str | None = None) -> None:
        """Move the branch's points after `step` into a new abandoned stretch."""
        stretch: dict[str, list[Point]] = {}
        for name, points in self.live.get(branch, {}).items():
            if only is not None and name != only:
                continue
            keep = [p for p in points if p[0] <= step]
            cut = [p for p in points if p[0] > step]
            if cut:
                # the stretch starts at the point it left from, so its line joins the live one
                stretch[name] = keep[-1:] + cut
                points[:] = keep
        if stretch:
            self.gone.setdefault(branch, []).append(stretch)

    def series(self) -> dict[str, dict[str, list[Point]]]:
        out: dict[str, dict[str, list[Point]]] = {"loss": {}, "lr": {}, "eval": {}}
        for branch, kinds in self.live.items():
            for name, points in kinds.items():
                out[_plot(name)][f"{name} · {branch}"] = points
            for n, stretch in enumerate(self.gone.get(branch, []), 1):
                for name, points in stretch.items():
                    out[_plot(name)][f"{name} · {branch} ({ABANDONED} {n})"] = points
        return {plot: {k: v for k, v in found.items() if v} for plot, found in out.items()}

    def steps(self) -> dict[str, tuple[int, int]]:
        found = {}
        for branch, kinds in self.live.items():
            steps = [p[0] for p in kinds.get("loss", [])]
            if steps:
                found[branch] = (steps[0], steps[-1])
        return found


def _plot(name: str) -> str:
    if name in ("loss", "eval loss"):
        return "loss"
    return "lr" if name == "lr" else "eval"


def tree_lines(view: BranchView) -> list[str]:
    """The tree as indented lines, the branch training goes on in marked."""
    tree, out = view.tree, []

    def walk(name: str, depth: int) -> None:
        info = tree.branches[name]
        where = view.steps.get(name)
        span = f" (steps {where[0]}-{where[1]})" if where else ""
        origin = ""
        if info.parent is not None:
            source = info.source.removeprefix(SNAPSHOT_PREFIX)
            shown = Path(source).name if not info.source.startswith(SNAPSHOT_PREFIX) else f"snapshot {source}"
            changes = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.settings.items())
            origin = f": from {shown or 'step ' + str(info.fork_step)} of {info.parent} at step {info.fork_step}"
            origin += f", {changes}" if changes else ""
        mark = " ◀ training here" if name == tree.current else ""
        out.append(f"{'  ' * max(depth - 1, 0)}{'└ ' if depth else ''}{name}{span}{origin}{mark}")
        for child in tree.children(name):
            walk(child, depth + 1)

    walk(ROOT if ROOT in tree.branches else next(iter(tree.branches)), 0)
    return out
