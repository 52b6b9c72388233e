"""Training checkpoints: everything needed to continue a run bit for bit.

A checkpoint folder (published atomically by `atomic.writing`)::

    step-40/
        COMPLETE.json            completion marker + manifest (sizes, hashes), written last
        trainer_state.json       position, parallel layout, model fingerprint, sampler, run config
        callbacks.pt             the callbacks' states (the control plane's live settings, ...)
        rng/rank00000.pt ...     Python, NumPy and torch (and CUDA) RNG states, one file per rank
        loop/rank00000.pt ...    the optimizer / schedule DeepSpeed does not hold (LOMO / AdaLomo's
                                 fused optimizer and its schedule), one file per rank; absent otherwise
        latest                   \\
        zero_to_fp32.py           | DeepSpeed's own layout, written by engine.save_checkpoint:
        global_step40/            | model, optimizer partitions per rank, lr scheduler; its
            mp_rank_00_model_states.pt, *zero_pp_rank_<r>_*_optim_states.pt, ...   / zero_to_fp32 reads it

`load_checkpoint` checks everything before it changes anything: the marker (an unfinished save is
refused), that every listed file is there, the layout (dp, tp, pp, ZeRO stage) and the model
(precision, method, parameter counts), that the data order is the same, and -- each rank the
files it reads -- every hash. Only then does DeepSpeed load the model, optimizer and scheduler,
followed by the callbacks, the position and the RNG states. The next `train()` starts at the
saved (epoch, micro-batch) and skips exactly what was trained.

A different layout is refused with both layouts named; the message says how DeepSpeed's
universal checkpoint conversion carries model and optimizer state to another layout for a new
run (not an exact resume: the data order and RNG streams of the new layout differ).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from engine.context import RunContext
from engine.parallel import ds_config
from engine.checkpoint import atomic
from engine.checkpoint.compatible import check_compatible, config_changes, layout_record, model_of
from engine.checkpoint.deepspeed_state import load_engine_state, save_engine_state
from engine.checkpoint.locations import CheckpointError, CorruptCheckpointError, MissingFilesError
from engine.checkpoint.agreement import Comm
from engine.rng import rng_state, set_rng_state
from contract.events import CheckpointEvent, ResumeEvent
from engine.checkpoint import locations
from engine.checkpoint import reading

STATE_FILE = "trainer_state.json"
CALLBACKS_FILE = "callbacks.pt"
RNG_DIR = "rng"
LOOP_DIR = "loop"
_RANKED = re.compile(r"zero_pp_rank_(\d+)_")
_RNG = re.compile(rf"(?:{RNG_DIR}|{LOOP_DIR})/rank(\d+)\.pt$")
# saves going on in this process (a rewind refuses to load in the middle of one)
SAVING: list[str] = []


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank{rank:05d}.pt"


def loop_file(rank: int) -> str:
    return f"{LOOP_DIR}/rank{rank:05d}.pt"


def ds_tag(step: int) -> str:
    return f"global_step{step}"  # DeepSpeed's own default tag


# -- what a checkpoint records --------------------------------------------------------------------


def sampler_state(sampler, run) -> dict | None:
    """The data order's identity and position: the run's batch sampler's state, at the run's
    epoch and micro-batch (None for a sampler without state)."""
    if not hasattr(sampler, "state_dict"):
        return None
    sampler.set_epoch(run.state.epoch)
    return sampler.state_dict(batches_done=run.state.batch_in_epoch)


def record_of(run: RunContext, sampler) -> dict:
    """What trainer_state.json records: position, layout, model, data order, config, versions."""
    state = run.state
    return {"position": {"epoch": state.epoch, "batch_in_epoch": state.batch_in_epoch,
                         "global_step": state.global_step, "total_steps": state.total_steps},
            "ds_tag": ds_tag(state.global_step), "layout": layout_record(run), "model": model_of(run),
            "sampler": sampler_state(sampler, run), "config": run.config.to_dict(), "versions": _versions()}


def loop_state(run: RunContext) -> dict | None:
    """This rank's optimizer and schedule where DeepSpeed's checkpoint does not hold them (the
    fused LOMO / AdaLomo optimizer is built after the engine, and so is its schedule); None when
    DeepSpeed holds both."""
    engine, state = run.engine, {}
    if run.optimizer is not None and run.optimizer is not engine.optimizer:
        state["optimizer"] = run.optimizer.state_dict()  # the fused one's holds its loss scale too
    if run.lr_scheduler is not None and run.lr_scheduler is not engine.lr_scheduler:
        state["lr_scheduler"] = run.lr_scheduler.state_dict()
    return state or None


def load_loop_state(run: RunContext, state: dict | None) -> None:
    if not state:
        return
    if "optimizer" in state:
        run.optimizer.load_state_dict(state["optimizer"])
        _keep_saved_dtypes(run.optimizer, state["optimizer"])
    if "lr_scheduler" in state:
        run.lr_scheduler.load_state_dict(state["lr_scheduler"])


def _keep_saved_dtypes(optimizer, saved: dict) -> None:
    """torch's Optimizer.load_state_dict casts floating-point state to its parameter's dtype, but
    a fused optimizer keeps fp32 state for bf16 weights (AdaLomo's second-moment factors): put
    those back as they were saved, bit for bit."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved.get("param_groups", []) for i in group["params"]]
    for pid, param in zip(ids, params):
        for key, value in saved.get("state", {}).get(pid, {}).items():
            now = optimizer.state.get(param, {}).get(key)
            if torch.is_tensor(value) and torch.is_tensor(now) and now.dtype != value.dtype:
                optimizer.state[param][key] = value.to(now.device, copy=True)


@contextlib.contextmanager
def saving(path: str) -> Iterator[None]:
    """Mark a save of `path` as going on in this process (engine.checkpoint.rewind refuses then)."""
    SAVING.append(path)
    try:
        yield
    finally:
        SAVING.remove(path)


# -- saving ---------------------------------------------------------------------------------------
def _points_latest(run: RunContext, path: str) -> bool:
    folder = getattr(run, "folder", None)
    if folder is None:
        return False
    return locations.location(path).parent.path.rstrip("/") == locations.location(str(folder.checkpoints)).path.rstrip("/")


def save_checkpoint(run: RunContext, path: str, *, states: dict[str, Any], sampler, saved_by: str = "manual",
                    metrics: dict | None = None, pointer: bool | None = None) -> str:
    """Write the full training state to `path` (local or fsspec URL); every rank calls this.

    `states`: the callbacks' and the loop's parts' states (stored in callbacks.pt); `sampler`: the
    run's batch sampler (its state is the data order's identity). `pointer`: update `latest` in
    the parent folder (default: when the parent is the run's checkpoints folder). `saved_by` and
    `metrics` go into the marker, where the schedule's keep-last / keep-best rules read them.
    Returns the checkpoint's URL.
    """
    started, comm = time.perf_counter(), Comm.current()
    state, engine = run.state, run.engine
    if engine.checkpoint_engine is None:  # every rank alike, before any collective of the save
        raise CheckpointError(f"{run.config.method.name} under ZeRO 3 cannot save training checkpoints: DeepSpeed's "
                              "ZeRO-3 engine writes the partitioned weights through an optimizer of its own, and "
                              f"{run.config.method.name} has none (use zero_stage 0, 1 or 2, or save the model "
                              "alone with save_model); nothing was written")
    record = record_of(run, sampler)
    meta = {"step": state.global_step, "epoch": state.epoch, "saved_by": saved_by,
            "metrics": dict(metrics or {})}
    pointer = _points_latest(run, path) if pointer is None else pointer
    with saving(path), atomic.writing(path, kind="training", meta=meta, pointer=pointer, comm=comm,
                                      emit=run.emit) as w:
        # a rank whose write fails must still reach DeepSpeed's barriers (atomic: one failure,
        # agreed by every rank); DeepSpeed's own `latest` is written below, outside them
        with ds_config.recording_checkpoint_files(engine) as written, \
                w.deferring(engine.checkpoint_engine, "save"), w.deferring(engine, "_copy_recovery_script"):
            save_engine_state(engine, str(w.local), record["ds_tag"], run.layout.checkpoint_client_state())
        w.claim_paths(written)
        if comm.rank == 0:
            (w.local / "latest").write_text(record["ds_tag"])  # what save_latest=True writes
        (w.local / RNG_DIR).mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), w.local / rng_file(comm.rank))
        w.claim(rng_file(comm.rank))
        loop = loop_state(run)
        if loop is not None:
            (w.local / LOOP_DIR).mkdir(parents=True, exist_ok=True)
            torch.save(loop, w.local / loop_file(comm.rank))
            w.claim(loop_file(comm.rank))
        if comm.rank == 0:
            (w.local / STATE_FILE).write_text(json.dumps(record, indent=1, default=str))
            torch.save(states, w.local / CALLBACKS_FILE)
    url = locations.location(path).url
    run.emit(CheckpointEvent(step=state.global_step, epoch=state.epoch, path=url,
                                 saved_by=saved_by, seconds=round(time.perf_counter() - started, 3)))
    return url


def _versions() -> dict:
    import deepspeed
    import transformers
    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}


# -- loading --------------------------------------------------------------------------------------
def files_read_by(files: list[str], rank: int, dp_rank: int) -> list[str]:
    """The manifest files rank `rank` reads to resume: its own partitions and RNG file, the shared
    model states and our state files. The rest (DeepSpeed's scripts) are checked by rank 0."""
    mine = []
    for rel in files:
        ranked, rng = _RANKED.search(rel), _RNG.search(rel)
        if ranked:
            ok = int(ranked.group(1)) == dp_rank
        elif rng:
            ok = int(rng.group(1)) == rank
        else:
            ok = "/" in rel or rel in (STATE_FILE, CALLBACKS_FILE) or rank == 0
        if ok:
            mine.append(rel)
    return mine


def read_record(folder: locations.Location) -> dict:
    try:
        return json.loads(folder.child(STATE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{folder.url}/{STATE_FILE} is damaged ({e}); nothing was loaded") from None


def precheck(run: RunContext, path: str) -> tuple[locations.Location, dict, dict]:
    """The checks of a training checkpoint that read only its marker and record, and change
    nothing: complete, every listed file there, this layout and model. (folder, marker, record)."""
    folder = locations.location(path)
    marker = reading.complete_marker(path, "training")
    missing = reading.missing_files(folder, marker)
    if missing:
        raise MissingFilesError(f"{folder.url} lacks {len(missing)} file(s) its manifest lists: "
                                f"{', '.join(missing[:6])}; nothing was loaded")
    record = read_record(folder)
    check_compatible(run, record, folder.url)
    return folder, marker, record


@contextlib.contextmanager
def verified(run: RunContext, path: str, sampler=None) -> Iterator[tuple[locations.Location, dict, dict, Path]]:
    """Check a training checkpoint completely (collective) and yield (folder, marker, record,
    local copy of this rank's files); raises before anything is changed."""
    comm = Comm.current()
    folder, marker, record = precheck(run, path)
    check_compatible(run, record, folder.url, sampler)
    mine = files_read_by(sorted(marker["files"]), comm.rank, run.env.dp_rank)
    local, temporary = reading.fetch(folder, mine)
    try:
        problems = comm.agree("; ".join(reading.verify(folder, marker, mine, local_root=local)) or None)
        if problems:
            raise CorruptCheckpointError(f"{folder.url} is damaged: {'; '.join(problems)}; nothing was loaded")
        yield folder, marker, record, local
    finally:
        if temporary:
            shutil.rmtree(local, ignore_errors=True)


def load_checkpoint(run: RunContext, path: str, *, sampler, restore_states: Callable[[dict], None],
                    announce: bool = True, fields: dict | None = None) -> dict:
    """Restore the training state saved at `path`; every rank calls this. `sampler`: the run's
    batch sampler (the data order must match); `restore_states` gets the saved states of the
    callbacks and the loop's parts. The same function restores a running engine in place (a
    rewind, engine.checkpoint.rewind, with `announce` False: it writes its own event). `fields`
    go into the `resume` event. Returns the marker."""
    started = time.perf_counter()
    with verified(run, path, sampler) as (folder, marker, record, local):
        restore(run, local, record, _read(local / CALLBACKS_FILE),
                _read(local / rng_file(run.env.rank)), _read_optional(local / loop_file(run.env.rank)),
                restore_states, what=folder.url)
    if announce:
        changes = config_changes(record.get("config", {}), run.config.to_dict())
        run.emit(ResumeEvent(checkpoint=folder.url, step=run.state.global_step,
                             epoch=run.state.epoch, batch_in_epoch=run.state.batch_in_epoch,
                             config_changes=changes, seconds=round(time.perf_counter() - started, 3),
                             **(fields or {})))
    return marker


def _read(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def _read_optional(path: Path) -> Any:
    return _read(path) if path.exists() else None


def load_weights(run: RunContext, path: str) -> None:
    """The model (and the optimizer state DeepSpeed keeps with it) of a training checkpoint; the
    position, scheduler, RNG streams and callbacks stay as they are. Collective."""
    with verified(run, path) as (_, _, record, local):
        load_engine_state(run.engine, local, record["ds_tag"], scheduler=False)


class RestoreError(CheckpointError):
    """A restore failed part-way: the run's state is partly the saved one (the message names the
    part that failed and the cause; the traceback is in the rank's log)."""


def restore(run: RunContext, local: Path, record: dict, states: dict, rng: dict, loop: dict | None,
            restore_states: Callable[[dict], None], what: str = "the checkpoint") -> None:
    """Put a saved training state into the run's (running or just built) engines: DeepSpeed's
    part from the folder `local` (model, optimizer, scheduler, in this layout's partitions), then
    the loop's own optimizer / schedule (`loop`), the callbacks' and loop parts' `states`, the
    position, and last the RNG streams `rng`. The one restore of a resume at start, a rewind
    from disk and a rewind from a snapshot (engine.checkpoint.snapshots).

    A failure part-way is a RestoreError naming `what` was loaded, the part that failed and the
    cause (its traceback goes to this rank's log): the run's state is then partly `what`'s, and
    the caller puts it back (engine.checkpoint.rewind) or ends the run.
    """
    parts: list[tuple[str, Callable[[], None]]] = [
        ("DeepSpeed's model, optimizer and schedule",
         lambda: load_engine_state(run.engine, local, record["ds_tag"])),
        ("the loop's own optimizer and schedule", lambda: load_loop_state(run, loop)),
        ("the callbacks' and the loop parts' states", lambda: restore_states(states)),
        ("the position and the RNG streams", lambda: _restore_position(run, record["position"], rng))]
    for name, load in parts:
        try:
            load()
        except Exception as e:  # noqa: BLE001 - named for the user; the traceback to the log
            traceback.print_exc()
            raise RestoreError(f"loading {what} failed while restoring {name}: {type(e).__name__}: {e}") from e


def _restore_position(run: RunContext, position: dict, rng: dict) -> None:
    run.state.epoch = int(position["epoch"])
    run.state.batch_in_epoch = int(position["batch_in_epoch"])
    run.state.global_step = int(position["global_step"])
    # last: nothing may draw random numbers between here and the next step
    set_rng_state(rng)



