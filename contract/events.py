"""The events a run writes to events.jsonl: one JSON object per line, each with a `type`.

events.jsonl is the durable record of a run: front ends rebuild plots and history from it, and
subscribers of the control socket receive its lines as they are written (contract.protocol).
Every event carries `type` and `time` (seconds since the epoch, added by the writer,
contract.run_folder.EventLog); the rest of its fields are declared below, one TypedDict per
type, so that writers and readers agree on names. They are plain dicts at run time; the types
are for the reader and the type checker. A reader should ignore fields and types it does not
know: later versions may add some.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal, TypedDict

from contract.protocol import RunState


class EventType(str, Enum):
    """The `type` of an event, and who writes it."""
    STATE = "state"              # the run changed state (manager, trainer, control plane, worker)
    SETUP = "setup"              # the engine is built: sizes and data summary (trainer)
    TRAIN = "train"              # metrics of one logged optimizer step (trainer's monitors)
    EVAL = "eval"                # evaluation results (trainer)
    COMMAND = "command"          # a control command was queued, done or failed (control plane)
    SET = "set"                  # live settings changed (control plane)
    CHAT_PAGE = "chat_page"      # the built-in chat page is served (control plane)
    CHECKPOINT = "checkpoint"    # a training checkpoint was written (checkpoint layer)
    CHECKPOINT_DELETED = "checkpoint_deleted"  # old checkpoints removed by the keep rule
    CHECKPOINT_FAILED = "checkpoint_failed"    # a save failed, alike on every rank (checkpoint layer)
    RESUME = "resume"            # training state restored from a checkpoint
    EXPORT = "export"            # a model / adapter exported in Hugging Face / PEFT format
    BEST_MODEL = "best_model"    # the best checkpoint's weights loaded at the end
    WARNING = "warning"          # something the user should know; the run goes on
    GUARD = "guard"              # the spike guard judged a step bad and acted (engine.guard_hook)
    DATA = "data"                # a training source added, reweighted, removed; an entry forgotten
    TEACH = "teach"              # an answer taught from the chat went into the inbox
    TEACH_CHECK = "teach_check"  # a taught prompt asked again: old and new answers
    EARLY_STOP = "early_stop"    # evaluations stopped improving: training ends (trainer)
    REWIND = "rewind"            # training state restored in place; later steps abandoned (engine.checkpoint.rewind)
    BRANCH = "branch"            # the run goes on as a new branch of the run folder's tree (contract.branches)
    SNAPSHOT = "snapshot"        # the training state kept in host memory, or one evicted


class _Event(TypedDict):
    type: str
    time: float


class StateEvent(_Event, total=False):
    """`state`: one of RunState's values. `error` (failed), `source` ("manager" when the run
    manager, not the engine, recorded it), `rank` (the rank that failed), `stopped_by_user`,
    `nproc` / `method` / `model` (starting)."""
    state: str
    step: int
    error: str
    source: str
    rank: int
    stopped_by_user: bool
    nproc: int
    method: str
    model: str


class SetupEvent(_Event, total=False):
    world_size: int
    dp_size: int
    precision: str
    total_steps: int
    parameters: int
    trainable_parameters: int
    train_samples: int
    eval_samples: int
    data: dict[str, Any]       # per split: the data report's summary
    warnings: list[str]        # DeepSpeed config warnings


class TrainEvent(_Event, total=False):
    """One logged step. The monitors add the rest: loss, lr, step_time, tokens, tokens_per_s,
    mem_mb, samples_per_source ({source name: samples drawn since the last record, all ranks})
    (and any custom monitor's numbers)."""
    step: int
    epoch: int
    total_steps: int
    loss: float
    lr: float
    step_time: float
    tokens: int
    tokens_per_s: float
    mem_mb: float
    samples_per_source: dict[str, int]


class EvalEvent(_Event, total=False):
    """Evaluation results, each metric as `eval/<name>` (eval/loss, eval/perplexity, ...)."""
    step: int
    epoch: int


class CommandEvent(_Event, total=False):
    """A control command's life: `queued` (with its wire `args`), then `done` (with `result`
    and `seconds`) or `failed` (with `error`). `status` reads are not recorded."""
    id: str
    cmd: str
    status: Literal["queued", "done", "failed"]
    step: int
    args: dict[str, Any]
    result: dict[str, Any]
    seconds: float
    error: str


class SetEvent(_Event, total=False):
    """The settings a `set` changed, with their values after and before. `step` is the last
    step done; the change applies from `applies_from_step` (step + 1), and `changes["lr"]` is
    the rate that step trains with, as the `train` records log each step's own rate."""
    step: int
    changes: dict[str, Any]
    before: dict[str, Any]
    applies_from_step: int


class ChatPageEvent(_Event, total=False):
    url: str    # without the token (control.json has the full URL)
    note: str


class CheckpointEvent(_Event, total=False):
    step: int
    epoch: int
    path: str
    saved_by: str
    seconds: float


class CheckpointFailedEvent(_Event, total=False):
    """`checkpoint_failed`: nothing was published and the partial folder is gone. `error` names
    each failing rank; on a full disk (`disk_full`) `needed_bytes` (estimated from the previous
    checkpoint) and `free_bytes`, and `foreseen` when the save was not started at all."""
    path: str
    kind: str
    error: str
    disk_full: bool
    needed_bytes: int | None
    free_bytes: int | None
    foreseen: bool


class ResumeEvent(_Event, total=False):
    checkpoint: str
    step: int
    epoch: int
    batch_in_epoch: int
    config_changes: dict[str, Any]
    seconds: float


class ExportEvent(_Event, total=False):
    kind: str   # "model" or "adapter"
    path: str
    step: int
    seconds: float


class RewindEvent(_Event, total=False):
    """`rewind`: every rank loaded `target` (`source`: its checkpoint URL or "snapshot:<name>")
    in place. Training goes on from `step`; `abandoned` is [first, last] of the steps given up
    ([] when none), `from_step` the step before the rewind. `reason`: "user", or the guard's."""
    target: str
    source: str
    step: int
    from_step: int
    abandoned: list[int]
    branch: str
    reason: str
    epoch: int
    batch_in_epoch: int
    seconds: float


class BranchEvent(RewindEvent, total=False):
    """`branch`: as a rewind, then the run goes on as branch `branch`, child of `parent`, forked
    at `step`; `changes`: the settings the branch command changed. Events after it without a
    `branch` field belong to this branch (contract.branches)."""
    parent: str
    changes: dict[str, Any]


class SnapshotEvent(_Event, total=False):
    """`snapshot`: `name` kept at `step` in host memory; `bytes` its size (every rank of this
    machine together), `kept` the names kept, `evicted` those dropped to make room, `total_bytes`
    what the kept ones take."""
    name: str
    step: int
    branch: str
    bytes: int
    total_bytes: int
    kept: list[str]
    evicted: list[str]
    seconds: float


class DataEvent(_Event, total=False):
    """`data`: `change` is add / weight / remove / forget; `source` the source after it (name,
    path, format, weight, kind, samples, seen, scheduled), `sources` all live ones; add reports
    `report`, `dropped` and `dropped_rows` (row numbers and why); weight `before`; forget `id`."""
    step: int
    change: Literal["add", "weight", "remove", "forget"]
    source: dict[str, Any]
    sources: list[dict[str, Any]]
    applies_from_step: int
    report: str
    dropped: int
    dropped_rows: list[str]
    before: float
    id: str


class TeachEvent(_Event, total=False):
    """`teach`: entry `id` (t1, t2 ...), `prompt` as the model saw it, `answer`, the greedy answer
    before (`old`), its rate (`per_step` samples in each of `steps` batches), `check_at_step`."""
    step: int
    id: str
    prompt: str
    answer: str
    old: str
    per_step: int
    steps: int
    check_at_step: int | None


class TeachCheckEvent(_Event, total=False):
    """`teach_check`: the prompt asked again `steps` steps after `taught_at_step`: `old` and `new`
    greedy answers, `learned` when the new one is the taught `answer`."""
    step: int
    id: str
    prompt: str
    answer: str
    old: str
    new: str
    taught_at_step: int
    steps: int
    learned: bool


class WarningEvent(_Event, total=False):
    message: str


class GuardEvent(_Event, total=False):
    """`guard`: the spike guard judged step `step` bad. `trigger`: nonfinite_loss, loss_spike,
    grad_norm or nonfinite_grad_norm; `value` and `threshold` (non-finite numbers as strings);
    `action`: skip, rewind (then `target`, `target_step`, `lr_scale`; the `rewind` and `set`
    events follow), pause (a `state` paused follows) or none (reported only: `reason` says why);
    `reason` in words; `update_applied`: whether the step's update was applied before the guard
    judged it; `rewinds` / `max_rewinds` and `skips_in_a_row` after this action."""
    step: int
    trigger: str
    action: str
    reason: str
    value: float | str | None
    threshold: float | str | None
    update_applied: bool
    target: str
    target_step: int
    lr_scale: float
    rewinds: int
    max_rewinds: int
    skips_in_a_row: int


class EarlyStopEvent(_Event, total=False):
    """`early_stop`: `metric` did not improve on `best` (by more than `threshold`) in `patience`
    evaluations in a row; the run ends after this step (the best checkpoint is loaded at the end
    when checkpoint.load_best_at_end)."""
    step: int
    metric: str
    value: float
    best: float
    best_step: int
    patience: int
    threshold: float


COMMAND_STATUSES = ("queued", "done", "failed")


def state_event(state: RunState | str, **fields: Any) -> dict[str, Any]:
    """A `state` event for `state` (checked against RunState), with `fields` (step, error, ...)."""
    return {"type": EventType.STATE.value, "state": RunState(state).value, **fields}


def run_state(events: Any, default: RunState | None = None) -> RunState | None:
    """The state the last `state` event among `events` names (None or `default` without one)."""
    state = default
    for event in events:
        if event.get("type") == EventType.STATE.value and event.get("state") in _STATE_VALUES:
            state = RunState(event["state"])
    return state


_STATE_VALUES = frozenset(s.value for s in RunState)
