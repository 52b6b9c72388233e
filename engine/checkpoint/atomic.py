"""Where checkpoints go and how a folder is published whole or not at all.

Every save and load takes a local path or an fsspec URL (``memory://``, ``s3://`` with s3fs
installed, ...), the counterpart of CoLLie's `protocol` argument.

Publishing (collective, :func:`writing`): every rank writes into a temporary sibling folder
``.tmp-<name>-<token>`` (for a remote URL: into a local staging folder, then uploads its own
files there). Each rank hashes the files it wrote (xxh3-128, over a memory map: a few GB/s, far
cheaper than the write); rank 0 then writes the completion marker ``COMPLETE.json`` -- the
manifest of every file with its size and hash -- renames the folder into place (moving an older
folder of that name aside first and deleting it after) and, for training checkpoints, points
``latest`` in the parent folder at it. A folder without its marker is never offered for resume:
a save killed at any moment leaves the previous checkpoint as it was, and the broken temporary
folder is deleted by the next save into the same parent.

Nothing is fsync'ed (DeepSpeed does not either, and syncing the small marker would, on ext4,
flush the whole checkpoint first): a killed process loses nothing the page cache holds, and
after a power loss a file whose bytes never reached the disk no longer matches its hash, so
loading it says so. The previous checkpoints are still there to resume from because pruning
calls flush_before_deleting first, paying for the sync only when something is deleted.

On object stores a rename is a copy, so there the marker written last is what makes a folder
complete; the swap of an existing folder of the same name is not atomic there.

A failed save fails alike on every rank (disk full, permissions, object storage, any cause): no
rank may leave the save while another still waits in one of its collectives, so a failure is
never raised where it happens. Each phase ends in an agreement -- preparing (rank 0: stale
folders, space, the temporary folder; broadcast), writing (every rank; DeepSpeed's writes go
through :meth:`FolderWriter.deferring`, so a rank whose write failed still goes through
DeepSpeed's barriers; all-gather), publishing (rank 0; broadcast) -- and then every rank raises
the same :class:`CheckpointError` or none. Rank 0 then removes the partial folder, and `emit`
(the run's event log) gets a ``checkpoint_failed`` event naming the failure.

A full disk is :class:`DiskFullError`, naming the folder, the space needed (estimated from the
newest complete checkpoint beside it, engine.checkpoint.space) and the space that was free.
When the estimate says the save cannot fit, nothing is written: a ``warning`` event and a
printed message say so before the save would start, and the save fails at once (writing until
the disk is full would also starve the event log). A folder is marked complete only after every
file in it was written in full: each rank checks its files (a torch zip archive ends with its
central directory, so one cut short is caught) and hashes them, and rank 0 checks every size in
the manifest on disk before writing the marker, then reads the marker back.

What a run does about a failed save is decided above this layer: the `save` command answers
the error and training goes on; a `stop` stops anyway; the schedule first deletes what its keep
rules would delete after the save and tries once more, and otherwise ends the run with the
disk-full message (engine.checkpoint.schedule).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from contract.events import CheckpointFailedEvent, Event, WarningEvent
from engine.checkpoint import space as disk
from engine.checkpoint.agreement import Comm
from engine.checkpoint.locations import (FORMAT, MARKER, TMP_PREFIX, CheckpointError, DiskFullError, Location,
                                         describe, local_files, location)
from engine.checkpoint.publish import (cut_short, newest_complete, publish, remove, remove_stale, sizes_differ,
                                       upload, write_marker, write_pointer)
from engine.checkpoint.reading import list_checkpoints, read_marker


# -- writing --------------------------------------------------------------------------------------
@dataclass
class FolderWriter:
    """Handed to the body of :func:`writing`: write under `local`, then `claim` what you wrote."""
    local: Path
    comm: Comm
    claimed: list[str] = field(default_factory=list)
    problem: dict | None = None  # this rank's first failure, agreed on at the end of the phase

    def claim(self, *relpaths: str) -> None:
        """Files this rank wrote (relative to `local`); unclaimed files there belong to rank 0."""
        self.claimed.extend(relpaths)

    def claim_paths(self, paths) -> None:
        for p in paths:
            self.claim(str(Path(p).resolve().relative_to(self.local.resolve())))

    def fail(self, error: BaseException) -> None:
        """Note a failure of this rank (the first one counts); the save then fails on every rank."""
        if self.problem is None:
            self.problem = {"error": f"{type(error).__name__}: {error}",
                            "disk_full": disk.is_disk_full(error, self.local)}

    @contextlib.contextmanager
    def deferring(self, owner: Any, name: str) -> Iterator[None]:
        """Within: a failure of `owner.<name>(...)` is noted (:meth:`fail`) instead of raised, and
        once one is noted the later calls write nothing. For writes made between collectives
        (DeepSpeed's checkpoint engine): this rank goes on through every barrier the others wait
        in, and the save fails on every rank where they agree."""
        original, own = getattr(owner, name), name in vars(owner)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.problem is not None:
                return None
            try:
                return original(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - raised at the agreement, on every rank
                self.fail(e)
                _drop_frames(e)
                return None

        setattr(owner, name, guarded)
        try:
            yield
        finally:
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


@contextlib.contextmanager
def writing(url: str, kind: str, meta: dict | None = None, pointer: bool = False,
            comm: Comm | None = None, emit: Callable[[Event], None] | None = None) -> Iterator[FolderWriter]:
    """Write a folder at `url` atomically, together with every rank (see the module docstring).

    The body writes its files under `writer.local` on each rank; when it returns, the folder is
    checked, hashed, marked complete and published, and `<parent>/latest` names it when
    `pointer`. A failure on any rank raises the same CheckpointError (DiskFullError for a full
    disk) on every rank, after the partial folder is removed; `emit` (rank 0's event log) gets
    the foreseen-full warning and the `checkpoint_failed` event.
    """
    comm = comm or Comm.current()
    target = location(url)
    prepared: tuple[str, disk.Space] | None = None
    problem = None
    if comm.rank == 0:
        try:
            prepared = _prepare(target, kind)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others hang
            problem = {"error": f"{type(e).__name__}: {e}", "disk_full": disk.is_disk_full(e, target.parent.path)}
    prepared, problem = comm.broadcast((prepared, problem))
    if prepared is None:
        raise _failed(target, kind, {0: problem}, disk.Space(), emit, comm)
    token, space = prepared
    if space.short:
        raise _full_foreseen(target, kind, space, emit, comm)
    tmp = target.parent.child(f"{TMP_PREFIX}{target.name}-{token}")
    writer = FolderWriter(Path(tmp.path), comm)
    staging = None
    if not target.is_local:
        try:
            writer.local = staging = Path(tempfile.mkdtemp(prefix="livetune-stage-"))
        except OSError as e:  # still go on to the agreement: the body's writes fail and are noted
            writer.fail(e)
            writer.local = Path(os.devnull) / "livetune-stage"
    try:
        try:
            yield writer
        except Exception as e:  # noqa: BLE001 - agreed on in _finish, then raised on every rank
            writer.fail(e)
            _drop_frames(e)
        _finish(writer, target, tmp, kind, meta or {}, pointer, space, emit)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _drop_frames(error: BaseException | None) -> None:
    """Forget the tracebacks of a failed write (and of the errors it chains): they hold its open
    file, so a deleted partial folder would keep its disk space while anyone holds the error."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:  # contextlib keeps the traceback too: clear the finished frames
            with contextlib.suppress(RuntimeError):  # a frame still running is left as it is
                tb.tb_frame.clear()
            tb = tb.tb_next
        error.__traceback__ = None
        error = error.__context__ or error.__cause__


def _prepare(target: Location, kind: str) -> tuple[str, disk.Space]:
    """Rank 0, before anything is written: stale folders gone, the space measured and, when the
    save can fit, the temporary folder made. Returns its token and the space."""
    remove_stale(target.parent)
    token = uuid.uuid4().hex[:10]
    space = space_for(target, kind)
    if target.is_local and not space.short:
        Path(target.parent.child(f"{TMP_PREFIX}{target.name}-{token}").path).mkdir(parents=True)
    return token, space


def space_for(target: Location, kind: str) -> disk.Space:
    """The space a save of `target` needs (the size of the folder it replaces, else of the newest
    complete folder of `kind` beside it) and the free space there; unknown for object stores."""
    if not target.is_local:
        return disk.Space()
    basis = read_marker(target) if target.exists() else None
    name: str | None = target.name
    if basis is None or basis.get("kind") != kind:
        siblings = [c for c in list_checkpoints(target.parent.url, kind) if c["name"] != target.name]
        basis, name = (siblings[-1], siblings[-1]["name"]) if siblings else (None, None)
    needed = disk.manifest_bytes(basis) if basis is not None else None
    return disk.Space(free=disk.free_bytes(target.parent.path), needed=needed, basis=name,
                      where=target.parent.path)


def _finish(writer: FolderWriter, target: Location, tmp: Location, kind: str, meta: dict,
            pointer: bool, space: disk.Space, emit: Callable[[Event], None] | None) -> None:
    comm = writer.comm
    files: dict[str, dict] = {}
    if writer.problem is None:
        try:
            cut = cut_short(writer.local, writer.claimed)
            if cut:
                raise OSError(f"written only in part: {', '.join(cut)}")
            files = describe(writer.local, writer.claimed)
            if not target.is_local:
                upload(writer.local, list(files), tmp)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others hang
            writer.fail(e)
    gathered = comm.all_gather((files, writer.problem))
    problems = {r: p for r, (_, p) in enumerate(gathered) if p}
    if comm.rank == 0 and not problems:
        try:
            manifest: dict[str, dict] = {}
            for rank_files, _ in gathered:
                manifest.update(rank_files)
            _mark_complete(writer.local, manifest, target, tmp, kind, meta)
            publish(tmp, target)
            if pointer:
                write_pointer(target.parent, target.name)
        except Exception as e:  # noqa: BLE001
            writer.fail(e)
            problems[0] = writer.problem
    problems = comm.broadcast(problems)
    if problems:
        raise _failed(target, kind, problems, space, emit, comm, tmp)


def _mark_complete(local: Path, manifest: dict[str, dict], target: Location, tmp: Location, kind: str,
                   meta: dict) -> None:
    """Rank 0: add its unclaimed files to the manifest, check every listed size on disk, write the
    marker and read it back. Raises rather than mark a folder whose files are not all whole."""
    rest = [rel for rel in local_files(local) if rel not in manifest and rel != MARKER]
    cut = cut_short(local, rest)
    if cut:
        raise OSError(f"written only in part: {', '.join(cut)}")
    manifest.update(describe(local, rest))
    if not target.is_local:
        upload(local, rest, tmp)
    elif sizes_differ(local, manifest):  # what every rank hashed is what is on the disk now
        raise OSError(f"files changed size after they were written: {', '.join(sizes_differ(local, manifest))}")
    marker = {"format": FORMAT, "kind": kind, "created": time.time(), **meta,
              "files": dict(sorted(manifest.items()))}
    write_marker(tmp, marker)
    if read_marker(tmp) != json.loads(json.dumps(marker)):
        raise OSError(f"{tmp.child(MARKER).url} does not read back as written")


# -- failures ---------------------------------------------------------------------------------------
def _failed(target: Location, kind: str, problems: dict[int, dict], space: disk.Space,
            emit: Callable[[Event], None] | None, comm: Comm, tmp: Location | None = None) -> CheckpointError:
    """The agreed error of a failed save (the same on every rank); rank 0 removes the partial
    folder and records the failure."""
    written = None
    if comm.rank == 0 and tmp is not None:
        written = disk.folder_bytes(tmp.path) if tmp.is_local else None
        with contextlib.suppress(Exception):  # a folder that cannot be removed now goes next save
            remove(tmp)
    ranks = "; ".join(f"rank {r}: {p['error']}" if comm.world > 1 else p["error"]
                      for r, p in sorted(problems.items()))
    newest = newest_complete(target, kind)
    keep = (f"the newest complete checkpoint, {newest}, is untouched" if newest
            else "no complete checkpoint is there yet")
    error: CheckpointError
    if any(p["disk_full"] for p in problems.values()):
        needed = space.needed
        need = (f"needs about {disk.mb(needed)} (the size of {space.basis})" if needed is not None
                else f"needs more than the {disk.mb(written)} written before the disk filled"
                if written else "needs more space")
        error = DiskFullError(f"disk full: saving {target.url} {need}, and {space.where or target.parent.url} "
                              f"had {disk.mb(space.free)} free when the save started ({ranks}). The partial "
                              f"folder was removed and {keep}; free some space and save again",
                              target.url, needed, space.free, foreseen=False)
    else:
        error = CheckpointError(f"saving {target.url} failed, nothing was published (the partial folder "
                                f"was removed and {keep}): {ranks}")
    _record_failure(error, target, kind, emit, comm)
    return error


def _full_foreseen(target: Location, kind: str, space: disk.Space, emit: Callable[[Event], None] | None,
                   comm: Comm) -> DiskFullError:
    """The save cannot fit: warned about before anything is written, then refused alike on every rank."""
    message = (f"disk full: saving {target.url} needs about {disk.mb(space.needed)} (the size of "
               f"{space.basis}), and {space.where} has {disk.mb(space.free)} free, so the save was not "
               f"started; {newest_complete(target, kind) or 'no checkpoint'} stays the newest complete "
               f"one. Free some space and save again")
    if comm.rank == 0:
        print(f"warning: {message}", flush=True)
        if emit is not None:
            emit(WarningEvent(message=message, path=target.url, needed_bytes=space.needed, free_bytes=space.free))
    error = DiskFullError(message, target.url, space.needed, space.free, foreseen=True)
    _record_failure(error, target, kind, emit, comm)
    return error


def _record_failure(error: CheckpointError, target: Location, kind: str, emit: Callable[[Event], None] | None,
                    comm: Comm) -> None:
    if comm.rank != 0 or emit is None:
        return
    full = {"needed_bytes": error.needed, "free_bytes": error.free, "foreseen": error.foreseen} \
        if isinstance(error, DiskFullError) else {}
    with contextlib.suppress(Exception):  # the event log may sit on the full disk itself
        emit(CheckpointFailedEvent(path=target.url, kind=kind, error=str(error),
                                   disk_full=isinstance(error, DiskFullError), **full))

