"""Rewind, branch and snapshot a live run in place: no process restarts, every rank at once.

    rewind_in_place(trainer, target, reason="user") -> RewindResult
    branch_in_place(trainer, target, name, reason="user") -> RewindResult
    take_snapshot(trainer, name=None) -> dict                    (the `snapshot` event)
    snapshot_store(trainer) -> SnapshotStore
    enter_resumed_branch(ctx) -> str                             (resume=<branch> at start)

Every rank calls them at the same step boundary, with the same arguments (the control plane's
handlers do, and so may the loop itself: the spike guard). `trainer` is the Trainer (its
public `part_states` / `restore_part_states` / `batch_sampler` give what a checkpoint holds
besides DeepSpeed's part; `ctx` is the run). The Trainer's `rewind` and `branch` call these.

A rewind restores exactly what a resume at start restores -- the model, the optimizer, the
schedule, the data position, every RNG stream and the live settings -- through the same
function (engine.checkpoint.state.load_checkpoint from disk, state.restore from a snapshot),
into the engines that are running; the Trainer (its `rewind` / `branch`) then starts its epoch
again at the restored position. The rewind is an event (`rewind`, or `branch`) naming
the abandoned steps; nothing already written is changed.

Targets: a snapshot's name; a checkpoint name (`step-40`) or step number (`40`) -- the present
branch's checkpoint, else the newest ancestor's at or before the fork; or a checkpoint folder.
Refused, with nothing changed (RewindError on every rank alike): an unknown target (the message
lists what there is), a rewind to a state off the present branch's path (another branch's, or an
ancestor's after the fork: `branch` goes on from those), a checkpoint of another layout or model (state.check_compatible names both),
an unfinished checkpoint (its save has not completed), and a rewind while a save is going on.

Transactional: what can be checked is checked before the engines are touched (`_precheck`); then
an in-memory copy of the present state is taken (a snapshot of its own, `UNDO`, outside the run's
snapshots and their bounds) and the target is loaded. A load that fails part-way on any rank is
undone on every rank from that copy, the loop starts its epoch again at the unchanged position,
and the command fails with the cause in words (RewindError; the traceback is in the rank's log):
the run goes on exactly as if the command had not been sent. Where no copy can be kept (ranks on
several machines, too little shared memory) or putting it back fails too, every rank raises
StateLost and the run ends, saying why.
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from contract.branches import ROOT, BranchTree, checkpoints_dir
from contract.events import BranchEvent, RewindEvent, SnapshotEvent
from engine.checkpoint import state as ckpt
from engine.checkpoint import compatible
from engine.checkpoint.locations import CheckpointError
from engine.checkpoint.agreement import Comm
from engine.checkpoint.snapshots import SnapshotError, SnapshotStore
from engine.checkpoint import reading
from engine.checkpoint import locations

SNAPSHOT_PREFIX = "snapshot:"
_STEP = re.compile(r"(?:step-)?(\d+)")


class RewindError(CheckpointError):
    """The rewind / branch / snapshot does not apply, or failed and was undone (the same on every
    rank); the run goes on as it was. `position_touched`: the data position was put back, so the
    loop must start its epoch again there."""

    def __init__(self, message: str, position_touched: bool = False):
        super().__init__(message)
        self.position_touched = position_touched


class StateLost(RuntimeError):
    """A rewind or branch failed part-way and the state from before it could not be put back: the
    run cannot go on (raised alike on every rank; the run ends with this message)."""


UNDO = "before-the-load"  # the in-memory copy a rewind takes first (never among the run's snapshots)


@dataclass
class RewindResult:
    """What a rewind did; `event()` is its `rewind` / `branch` event."""
    target: str               # as asked
    source: str               # the checkpoint URL, or "snapshot:<name>"
    step: int                 # training goes on after this step
    from_step: int            # the step before the rewind
    abandoned: list[int]      # [first, last] steps given up; [] when none
    branch: str               # the branch training goes on in
    epoch: int
    batch_in_epoch: int
    reason: str = "user"
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def event(self, model: type[RewindEvent] | type[BranchEvent] = RewindEvent) -> RewindEvent | BranchEvent:
        """The `rewind` (or `branch`) event of what was done."""
        fields = asdict(self)
        extra = fields.pop("extra")
        return model(**fields, **extra)


# -- the run's parts ----------------------------------------------------------------------------------
def snapshot_store(trainer) -> SnapshotStore:
    """The run's snapshots (the Trainer's, bounded by the checkpoint config)."""
    return trainer.snapshots


def current_branch(trainer) -> str:
    return getattr(trainer.folder, "branch", ROOT)


def tree_of(trainer) -> BranchTree:
    return BranchTree.load(trainer.folder.root)


# -- targets --------------------------------------------------------------------------------------------
def resolve(trainer, target: str) -> tuple[str, str]:
    """(source, owning branch) of `target`: "snapshot:<name>" or a checkpoint URL."""
    target = str(target).strip()
    store = snapshot_store(trainer)
    name = target.removeprefix(SNAPSHOT_PREFIX)
    snap = store.get(name)
    if snap is not None:
        return SNAPSHOT_PREFIX + name, snap.branch
    if target.startswith(SNAPSHOT_PREFIX):
        raise RewindError(f"no snapshot named {name!r} (kept: {', '.join(store.names()) or 'none'})")
    match = _STEP.fullmatch(target)
    tree = tree_of(trainer)
    if match is not None:
        return _checkpoint_of_step(trainer, tree, int(match.group(1)), target)
    if Path(target).is_dir():
        folder = Path(target).resolve()
        if reading.read_marker(locations.location(str(folder))) is None:
            raise RewindError(f"{target} is not a complete training checkpoint (its save has not "
                              "finished, or it is no checkpoint); nothing was changed")
        return str(folder), _owner(trainer, tree, folder.parent)
    raise RewindError(f"{target!r} is no checkpoint or snapshot of this run; " + _available(trainer, tree))


def _checkpoint_of_step(trainer, tree: BranchTree, step: int, target: str) -> tuple[str, str]:
    branch = current_branch(trainer)
    chain = tree.ancestry(branch) if branch in tree.branches else [branch]
    limit = None  # an ancestor's checkpoints count up to the fork its child on the chain took
    for name in reversed(chain):
        folder = checkpoints_dir(trainer.folder.root, name) / f"step-{step}"
        if (limit is None or step <= limit) and folder.is_dir():
            if reading.read_marker(locations.location(str(folder))) is None:
                raise RewindError(f"step-{step} of branch {name!r} is not complete (its save has not "
                                  "finished); nothing was changed")
            return locations.location(str(folder)).url, name
        info = tree.branches.get(name)
        limit = info.fork_step if info is not None else None
    raise RewindError(f"no checkpoint of step {step} on branch {branch!r} or its ancestors; "
                      + _available(trainer, tree))


def _check_on_path(trainer, source: str, owner: str) -> None:
    """A rewind goes back along the present branch only: to its own states, or an ancestor's up
    to the fork its child on the path took (`branch` goes on from anywhere)."""
    tree, branch = tree_of(trainer), current_branch(trainer)
    chain = tree.ancestry(branch) if branch in tree.branches else [branch]
    what = f"snapshot {source[len(SNAPSHOT_PREFIX):]!r}" if source.startswith(SNAPSHOT_PREFIX) else source
    if owner not in chain:
        raise RewindError(f"{what} belongs to branch {owner!r}, which is not on the path of the present branch "
                          f"{branch!r} ({' > '.join(chain)}); use branch to go on from it")
    i = chain.index(owner)
    if i == len(chain) - 1:
        return
    if source.startswith(SNAPSHOT_PREFIX):
        step = snapshot_store(trainer).get(source[len(SNAPSHOT_PREFIX):]).step  # type: ignore[union-attr]
    else:
        step = int((reading.read_marker(locations.location(source)) or {}).get("step", 0))
    fork = tree.branches[chain[i + 1]].fork_step
    if step > fork:
        raise RewindError(f"{what} is step {step} of branch {owner!r}, after branch {chain[i + 1]!r} forked from "
                          f"it at step {fork}, so not on the present branch's path; use branch to go on from it")


def _owner(trainer, tree: BranchTree, collection: Path) -> str:
    for name in tree.branches:
        if checkpoints_dir(trainer.folder.root, name).resolve() == collection.resolve():
            return name
    return current_branch(trainer)


def path_limits(trainer) -> dict[str, int | None]:
    """The branches on the present branch's path, each with the last step of it on the path (the
    fork its child on the path took; None for the present branch itself)."""
    tree, branch = tree_of(trainer), current_branch(trainer)
    chain = tree.ancestry(branch) if branch in tree.branches else [branch]
    return {name: tree.branches[chain[i + 1]].fork_step if i + 1 < len(chain) else None
            for i, name in enumerate(chain)}


def available(trainer) -> dict[str, Any]:
    """What a rewind can go back to: the checkpoints on the present branch's path (its own, and
    each ancestor's up to the fork), by branch, oldest first, and the snapshots on that path."""
    limits = path_limits(trainer)
    found = {name: [c["name"] for c in reading.list_checkpoints(str(checkpoints_dir(trainer.folder.root, name)))
                    if limit is None or c["step"] <= limit] for name, limit in limits.items()}
    snaps = [s.name for s in snapshot_store(trainer).snapshots
             if s.branch in limits and (limits[s.branch] is None or s.step <= limits[s.branch])]  # type: ignore[operator]
    return {"checkpoints": found, "snapshots": snaps}


def _available(trainer, tree: BranchTree) -> str:
    there = available(trainer)
    ckpts = "; ".join(f"{b}: {', '.join(n) or 'none'}" for b, n in there["checkpoints"].items())
    return f"checkpoints ({ckpts}); snapshots: {', '.join(there['snapshots']) or 'none'}"


# -- rewind ----------------------------------------------------------------------------------------------
def rewind_in_place(trainer, target: str, reason: str = "user", *, emit: bool = True,
                    any_branch: bool = False) -> RewindResult:
    """Load `target` into the running engines on every rank (collective) and make the loop go on
    from there; returns what was done (and, when `emit`, writes the `rewind` event). The target
    must lie on the present branch's path, unless `any_branch` (what `branch` does).

    Transactional: everything that can be checked is checked before the engines are touched, and
    a load that still fails part-way (on any rank) is undone (see `_load_or_undo`)."""
    if ckpt.SAVING:
        raise RewindError(f"a save is going on ({', '.join(ckpt.SAVING)}); rewind once it has finished")
    started, before = time.perf_counter(), trainer.state.global_step
    source, owner = resolve(trainer, target)
    if not any_branch:
        _check_on_path(trainer, source, owner)
    _precheck(trainer, source)
    _load_or_undo(trainer, source)
    step = trainer.state.global_step
    result = RewindResult(target=str(target), source=source, step=step, from_step=before,
                          abandoned=[step + 1, before] if before > step else [], branch=current_branch(trainer),
                          epoch=trainer.state.epoch, batch_in_epoch=trainer.state.batch_in_epoch, reason=reason,
                          seconds=round(time.perf_counter() - started, 4))
    if emit:
        trainer.emit(result.event(RewindEvent))
    return result


def _precheck(trainer, source: str) -> None:
    """What can be known before anything is loaded: the target is complete and of this layout
    and model (the data order and the files' hashes are checked by the load, every rank its own)."""
    if source.startswith(SNAPSHOT_PREFIX):
        name = source[len(SNAPSHOT_PREFIX):]
        compatible.check_compatible(trainer.ctx, snapshot_store(trainer).get(name).record, f"snapshot {name}")  # type: ignore[union-attr]
    else:
        ckpt.precheck(trainer.ctx, source)


def _load(trainer, source: str) -> None:
    if source.startswith(SNAPSHOT_PREFIX):
        snapshot_store(trainer).restore(trainer.ctx, source[len(SNAPSHOT_PREFIX):], trainer.restore_part_states,
                                        trainer.batch_sampler())
    else:
        ckpt.load_checkpoint(trainer.ctx, source, sampler=trainer.batch_sampler(),
                             restore_states=trainer.restore_part_states, announce=False)


def _load_or_undo(trainer, source: str) -> None:
    """Load `source`; when that fails on any rank, put back on every rank the state from before
    (an in-memory copy taken first: `UNDO`), make the loop start its epoch again there (the data
    position was touched) and raise RewindError naming the cause. When the state cannot be put
    back, raise StateLost on every rank: the run cannot go on."""
    comm, sampler = Comm.current(), trainer.batch_sampler()
    position = ckpt.sampler_state(sampler, trainer.ctx)  # the data position, should only it move
    undo, why_no_undo = _undo_point(trainer)
    try:
        problem = None
        try:
            _load(trainer, source)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it; the traceback goes to the log
            if not isinstance(e, ckpt.RestoreError):  # (a RestoreError's is printed where it happened)
                traceback.print_exc()
            problem = (_worded(e), not isinstance(e, CheckpointError) or isinstance(e, ckpt.RestoreError))
        problems = [p for p in comm.all_gather(problem) if p is not None]
        if not problems:
            return
        cause, touched = _same_text([p[0] for p in problems]), any(p[1] for p in problems)
        if undo is None and touched:
            raise StateLost(f"{cause}; the state from before could not be put back, as no copy of it "
                            f"could be kept ({why_no_undo}), so the run cannot go on: resume it from its "
                            "newest checkpoint")
        lost = None
        try:
            if touched:
                undo.restore(trainer.ctx, UNDO, trainer.restore_part_states, sampler)  # type: ignore[union-attr]
            elif position is not None:  # only the checks ran, and they may have moved the data position
                sampler.load_state_dict(position)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            lost = _worded(e)
        lost_everywhere = [p for p in comm.all_gather(lost) if p is not None]
        if lost_everywhere:
            raise StateLost(f"{cause}; putting back the state from before failed too "
                            f"({_same_text(lost_everywhere)}), so the run cannot go on: resume it from "
                            "its newest checkpoint")
        raise RewindError(f"{cause}; the run was put back as it was at step {trainer.state.global_step}"
                          f"{' (from an in-memory copy taken before the load)' if touched else ''} "
                          "and goes on unchanged", position_touched=True)
    finally:
        if undo is not None:
            undo.close()


def _undo_point(trainer) -> tuple[SnapshotStore | None, str]:
    """An in-memory copy of the whole training state now (a snapshot of its own, outside the
    run's snapshots and their bounds), to put back should a load fail part-way; (None, why) when
    none can be kept (ranks on several machines, shared memory too small)."""
    store = SnapshotStore(keep=1, max_mib=0)
    try:
        store.take(trainer.ctx, UNDO, current_branch(trainer), trainer.part_states(), trainer.batch_sampler())
    except SnapshotError as e:
        store.close()
        return None, str(e)
    return store, ""


def _worded(error: BaseException) -> str:
    """An error as the user reads it: our own errors say what failed in words; others get their
    type named (the traceback is in the rank's log)."""
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def _same_text(problems: list[str]) -> str:
    """The ranks' problems: one text when every rank had the same one."""
    unique = list(dict.fromkeys(problems))
    return unique[0] if len(unique) == 1 else "; ".join(unique)
def branch_in_place(trainer, target: str, name: str, reason: str = "user",
                    settings: dict[str, Any] | None = None) -> RewindResult:
    """Rewind to `target` and go on as the new branch `name` of the run folder's tree (collective).
    The branch the run leaves keeps its checkpoints. `settings` (the branch command's changes)
    are recorded in the tree; the caller applies them (the control plane's `set`)."""
    tree = tree_of(trainer)
    if name in tree.branches:
        raise RewindError(f"branch {name!r} exists already (branches: {', '.join(tree.branches)})")
    parent_now = current_branch(trainer)
    source, owner = resolve(trainer, target)
    result = rewind_in_place(trainer, target, reason, emit=False, any_branch=True)
    tree.add(name, owner, result.step, source, settings)
    tree.current = name
    if trainer.env.rank == 0:
        tree.save(trainer.folder.root)
    switch_branch(trainer, name)
    result.branch = name
    result.extra = {"parent": owner, "left": parent_now, "changes": dict(settings or {})}
    trainer.emit(result.event(BranchEvent))
    return result


def switch_branch(run, name: str) -> None:
    """Make `name` the branch training writes to: its checkpoints folder, its events' tag.
    `run`: the Trainer or its RunContext."""
    ctx = getattr(run, "ctx", run)
    ctx.folder = replace(ctx.folder, branch=name)
    ctx.folder.checkpoints.mkdir(parents=True, exist_ok=True)
    if ctx.events is not None:
        ctx.events.branch = name


def enter_resumed_branch(ctx) -> str:
    """For `resume=` at start: when the value names a branch of the run folder's tree (or is
    `latest`, or a checkpoint of a branch), training goes on in that branch -- its checkpoints,
    its events -- and the tree records it as the present one. Returns the value to resolve:
    `latest` for a branch name (its newest checkpoint), else the value as it was."""
    value, root = ctx.config.resume, ctx.folder.root
    tree = BranchTree.load(root)
    if value in tree.branches and "/" not in value:
        branch, value = value, "latest"
    elif value == "latest":
        branch = tree.current
    else:
        branch = next((n for n in tree.branches if Path(value).resolve().parent ==
                       checkpoints_dir(root, n).resolve()), None)
    if branch is None or len(tree.branches) == 1:
        return value  # no tree: the run folder is as it always was
    switch_branch(ctx, branch)
    if tree.current != branch and ctx.env.rank == 0:
        tree.current = branch
        tree.save(root)
    return value


# -- snapshot --------------------------------------------------------------------------------------------
def take_snapshot(trainer, name: str | None = None) -> dict[str, Any]:
    """Keep the training state in host memory as snapshot `name` (default snap-<step>; collective);
    writes and returns the `snapshot` event."""
    store = snapshot_store(trainer)
    name = name or f"snap-{trainer.state.global_step}"
    if store.get(name) is not None:  # the default name of a second snapshot at one step
        raise RewindError(f"a snapshot named {name!r} exists already (kept: {', '.join(store.names())})")
    started = time.perf_counter()
    try:
        snap, evicted = store.take(trainer.ctx, name, current_branch(trainer), trainer.part_states(),
                                   trainer.batch_sampler())
    except SnapshotError as e:
        raise RewindError(str(e)) from None
    event = SnapshotEvent(name=name, step=snap.step, branch=snap.branch, bytes=snap.bytes,
                          total_bytes=store.total_bytes(), kept=store.names(), evicted=evicted,
                          seconds=round(time.perf_counter() - started, 4))
    trainer.emit(event)
    return event.record()
