"""Snapshots: the complete training state kept in host memory, for rewinds without the disk.

A snapshot holds what a training checkpoint holds (engine.checkpoint.state), every rank its own
part: the callbacks' and loop parts' states, the position, the RNG streams and the loop's own
optimizer / schedule as Python objects (CPU tensors), and DeepSpeed's part -- the model and
optimizer partitions and the schedule, in this layout's own partitioning -- written by
DeepSpeed's `save_checkpoint` into a folder on the machine's shared-memory file system
(/dev/shm, tmpfs: host RAM, never the disk). Why DeepSpeed's writer and not our own copy of the
partitions: DeepSpeed's save/load is the one piece of code that knows every layout (ZeRO 0-3
flat partitions, AutoTP shards, pipeline layer files) and loads them back into a running
engine; a second copy of that knowledge would drift. A rewind from a snapshot then runs the very
restore a resume runs (`state.restore`), minus the hashing of files nobody else could touch.

Bounded by `checkpoint.snapshots_keep` (count) and `checkpoint.snapshots_max_mib` (host memory
of this machine's ranks together); the oldest snapshots go first. A snapshot larger than the
bound alone, or /dev/shm too small for it, is refused with the sizes named. Every rank must be on
one machine (each machine's /dev/shm is its own; DeepSpeed's shared files are written once).
The folder is removed when the snapshot is evicted and when the run's process ends; a run killed
by a signal leaves its folder (<pid> in its name), and the next snapshot taken on the machine
removes the folders of processes that are gone (`sweep_stale`).
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from engine.checkpoint import state as ckpt
from engine.checkpoint import compatible, deepspeed_state
from engine.checkpoint.locations import CheckpointError
from engine.checkpoint.agreement import Comm
from engine.context import RunContext
from engine.rng import rng_state

SHM = Path("/dev/shm")
PREFIX = "livetune-snapshots-"  # + the pid of the rank 0 that made it


def sweep_stale(base: Path) -> list[str]:
    """Remove the snapshot folders of processes that are gone (a run killed by a signal runs no
    clean-up, and tmpfs keeps its files in RAM until someone deletes them)."""
    removed = []
    for folder in base.glob(f"{PREFIX}*"):
        pid = folder.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SnapshotError(CheckpointError):
    """A snapshot could not be taken or used (named); nothing was changed."""


@dataclass
class Snapshot:
    """One rank's part of a snapshot."""
    name: str
    step: int
    branch: str
    folder: Path                      # DeepSpeed's files (tmpfs)
    record: dict                      # as trainer_state.json
    states: dict[str, Any]            # callbacks and loop parts (as callbacks.pt)
    rng: dict
    loop: dict | None
    bytes: int = 0                    # this machine's ranks together (measured by rank 0)
    created: float = field(default_factory=time.time)


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in a nest of dicts / lists (the states kept as Python objects)."""
    if hasattr(obj, "element_size") and hasattr(obj, "nelement"):
        return obj.element_size() * obj.nelement()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class SnapshotStore:
    """The run's snapshots on this rank, oldest first (every rank holds one, in step)."""

    def __init__(self, keep: int, max_mib: int):
        self.keep, self.max_bytes = keep, max_mib * 2**20
        self.snapshots: list[Snapshot] = []
        self._root: Path | None = None

    # -- where -------------------------------------------------------------------------------------
    def _base(self, comm: Comm) -> Path:
        """This run's snapshot folder (rank 0 makes it, every rank gets its name)."""
        if self._root is None:
            name = None
            if comm.rank == 0:
                base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
                sweep_stale(base)
                name = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base)
            self._root = Path(comm.broadcast(name))
            if comm.rank == 0:
                atexit.register(shutil.rmtree, self._root, True)
        return self._root

    def names(self) -> list[str]:
        return [s.name for s in self.snapshots]

    def get(self, name: str) -> Snapshot | None:
        return next((s for s in self.snapshots if s.name == name), None)

    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.snapshots)

    # -- taking one ----------------------------------------------------------------------------------
    def take(self, run: RunContext, name: str, branch: str, states: dict[str, Any], sampler) -> tuple[Snapshot, list[str]]:
        """Keep the training state now as snapshot `name` (collective); returns it and the names
        evicted to stay within the bounds. `states`: the callbacks' and loop parts' states."""
        comm = Comm.current()
        if self.keep <= 0:
            raise SnapshotError("snapshot: checkpoint.snapshots_keep is 0, so snapshots are off")
        if os.environ.get("LOCAL_WORLD_SIZE", str(comm.world)) != str(comm.world):
            raise SnapshotError("snapshot: the ranks span several machines; snapshots live in one machine's "
                                "memory (use save and rewind to the checkpoint instead)")
        if self.get(name) is not None:
            raise SnapshotError(f"snapshot: a snapshot named {name!r} exists already (kept: {', '.join(self.names())})")
        if run.engine.checkpoint_engine is None:  # DeepSpeed's ZeRO-3 engine without an optimizer of its own
            raise SnapshotError(f"snapshot: {run.config.method.name} under ZeRO 3 keeps no state DeepSpeed can "
                                "write (its ZeRO-3 engine writes the weights through an optimizer of its own); "
                                "use zero_stage 0, 1 or 2; nothing was kept")
        started = time.perf_counter()
        folder = self._base(comm) / name
        record = ckpt.record_of(run, sampler)
        problem = None
        try:
            deepspeed_state.save_engine_state(run.engine, str(folder), record["ds_tag"], run.layout.checkpoint_client_state())
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            problem = f"{type(e).__name__}: {e}"
        problems = [p for p in comm.all_gather(problem) if p]
        if problems:
            shutil.rmtree(folder, ignore_errors=True)
            raise SnapshotError(f"snapshot {name!r} could not be written to {folder.parent} "
                                f"({'; '.join(problems)}); nothing was kept")
        snap = Snapshot(name, run.state.global_step, branch, folder, record, copy.deepcopy(states),
                        rng_state(), copy.deepcopy(ckpt.loop_state(run)))
        comm.barrier()  # every rank's files are written before rank 0 measures them
        # DeepSpeed's files of every rank (one machine), and every rank's states held as objects
        held = sum(comm.all_gather(_tensor_bytes([snap.states, snap.loop, snap.rng])))
        snap.bytes = int(comm.broadcast(_folder_bytes(folder) if comm.rank == 0 else 0)) + held
        if self.max_bytes and snap.bytes > self.max_bytes:
            self._drop(snap, comm)
            raise SnapshotError(f"snapshot: the training state takes {snap.bytes / 2**20:.1f} MiB, more than "
                                f"checkpoint.snapshots_max_mib={self.max_bytes // 2**20}; nothing was kept")
        self.snapshots.append(snap)
        evicted = self._evict(comm)
        snap.created = time.time()
        self.seconds = round(time.perf_counter() - started, 4)
        return snap, evicted

    def _evict(self, comm: Comm) -> list[str]:
        evicted = []
        while len(self.snapshots) > self.keep or (self.max_bytes and self.total_bytes() > self.max_bytes):
            old = self.snapshots.pop(0)
            self._drop(old, comm)
            evicted.append(old.name)
        return evicted

    def _drop(self, snap: Snapshot, comm: Comm) -> None:
        comm.barrier()  # nobody reads it any more
        if comm.rank == 0:
            shutil.rmtree(snap.folder, ignore_errors=True)

    # -- going back to one -----------------------------------------------------------------------------
    def restore(self, run: RunContext, name: str, restore_states: Callable[[dict], None], sampler) -> Snapshot:
        """Put snapshot `name` into the running engines (collective; the same restore as a resume).
        `sampler`: the run's batch sampler, which takes the snapshot's data position."""
        snap = self.get(name)
        if snap is None:
            raise SnapshotError(f"no snapshot named {name!r} (kept: {', '.join(self.names()) or 'none'})")
        compatible.check_compatible(run, snap.record, f"snapshot {name}", sampler)  # and the data position
        ckpt.restore(run, snap.folder, snap.record, copy.deepcopy(snap.states), snap.rng,
                     copy.deepcopy(snap.loop), restore_states, what=f"snapshot {name!r}")
        return snap

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        self.snapshots.clear()
