"""The events a run writes to events.jsonl: one JSON object per line, each with a `type`.

events.jsonl is the durable record of a run: front ends rebuild plots and history from it, and
subscribers of the control socket receive its lines as they are written (contract.protocol).
Every event carries `type` and `time` (seconds since the epoch, added by the writer,
contract.run_folder.EventLog); the rest of its fields are declared below, one pydantic model per
type (every EventType has one), so that writers and readers agree on names and types. Writers
build an event through its model (`TrainEvent(step=3, loss=2.1)`); the one writer
(EventLog.emit) and the one reader (EventTail) check every event through one TypeAdapter over the
union of the models, told apart by `type` (`check_event`, `parse_event`), so a misspelt type or a
field of the wrong type fails where it is written. Declared fields are optional (an event says what it
knows); extra fields are allowed (monitors add metrics, later versions may add fields), and a
reader ignores what it does not know.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from contract.protocol.states import RunState


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
    GUARD = "guard"              # the spike guard judged a step bad and acted (engine.guard.hook)
    DATA = "data"                # a training source added, reweighted, removed; an entry forgotten
    TEACH = "teach"              # an answer taught from the chat went into the inbox
    TEACH_CHECK = "teach_check"  # a taught prompt asked again: old and new answers
    EARLY_STOP = "early_stop"    # evaluations stopped improving: training ends (trainer)
    REWIND = "rewind"            # training state restored in place; later steps abandoned (engine.checkpoint.rewind)
    BRANCH = "branch"            # the run goes on as a new branch of the run folder's tree (contract.branches)
    SNAPSHOT = "snapshot"        # the training state kept in host memory, or one evicted
    RANK_FAILED = "rank_failed"  # a rank died or hung, and the run restarts (manager, supervisor.restart)
    RESTART = "restart"          # the whole group relaunched from the latest complete checkpoint (manager)
    SAMPLES = "samples"          # a GRPO step's sampled answers, their rewards and advantages (rank 0)

    def __str__(self) -> str:  # its value in messages and f-strings, as in the log
        return self.value


class CommandStatus(str, Enum):
    """A control command's life in `command` events."""
    QUEUED = "queued"
    DONE = "done"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class Event(BaseModel):
    """What every event has: its `type`, `time` (added by the writer) and, once the run has
    branches, the `branch` it belongs to."""
    model_config = ConfigDict(extra="allow", use_enum_values=True)
    type: EventType
    time: float | None = None
    branch: str | None = None

    def record(self) -> dict[str, Any]:
        """The event as the JSON object written to events.jsonl: the fields it was given, and
        its type (non-finite numbers stay numbers: the log is read by Python's json)."""
        return {"type": EventType(self.type).value, **self.model_dump(exclude_unset=True, exclude={"type"})}


class StateEvent(Event):
    """`state`: one of RunState's values. `error` (failed), `source` ("manager" when the run
    manager, not the engine, recorded it), `rank` (the rank that failed), `stopped_by_user`,
    `nproc` / `method` / `model` (starting)."""
    type: Literal[EventType.STATE] = EventType.STATE
    state: RunState | None = None
    step: int | None = None
    error: str | None = None
    source: str | None = None
    rank: int | None = None
    stopped_by_user: bool | None = None
    nproc: int | None = None
    method: str | None = None
    model: str | None = None
    slurm_job: str | None = None  # a Slurm run's job id (starting)
    chat_only: bool | None = None  # a chat-only copy of a checkpoint or export
    reason: str | None = None      # why it ended so (a stop the manager finished, a cancelled job)


class SetupEvent(Event):
    type: Literal[EventType.SETUP] = EventType.SETUP
    world_size: int | None = None
    dp_size: int | None = None
    precision: str | None = None
    total_steps: int | None = None
    parameters: int | None = None
    trainable_parameters: int | None = None
    train_samples: int | None = None
    eval_samples: int | None = None
    data: dict[str, Any] | None = None       # per split: the data report's summary
    warnings: list[str] | None = None        # DeepSpeed config warnings


class TrainEvent(Event):
    """One logged step. The monitors add the rest: loss, lr, step_time, tokens, tokens_per_s,
    mem_mb, samples_per_source ({source name: samples drawn since the last record, all ranks})
    (and any custom monitor's numbers)."""
    type: Literal[EventType.TRAIN] = EventType.TRAIN
    step: int | None = None
    epoch: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    lr: float | None = None
    step_time: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    mem_mb: float | None = None
    samples_per_source: dict[str, int] | None = None


class EvalEvent(Event):
    """Evaluation results, each metric as `eval/<name>` (eval/loss, eval/perplexity, ...)."""
    type: Literal[EventType.EVAL] = EventType.EVAL
    step: int | None = None
    epoch: int | None = None


class CommandEvent(Event):
    """A control command's life: `queued` (with its wire `args`), then `done` (with `result`
    and `seconds`) or `failed` (with `error`). `status` reads are not recorded."""
    type: Literal[EventType.COMMAND] = EventType.COMMAND
    id: str | None = None
    cmd: str | None = None
    status: CommandStatus | None = None
    step: int | None = None
    args: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    seconds: float | None = None
    error: str | None = None


class SetEvent(Event):
    """The settings a `set` changed, with their values after and before. `step` is the last
    step done; the change applies from `applies_from_step` (step + 1), and `changes["lr"]` is
    the rate that step trains with, as the `train` records log each step's own rate."""
    type: Literal[EventType.SET] = EventType.SET
    step: int | None = None
    changes: dict[str, Any] | None = None
    before: dict[str, Any] | None = None
    applies_from_step: int | None = None


class ChatPageEvent(Event):
    type: Literal[EventType.CHAT_PAGE] = EventType.CHAT_PAGE
    url: str | None = None    # without the token (control.json has the full URL)
    note: str | None = None


class CheckpointEvent(Event):
    type: Literal[EventType.CHECKPOINT] = EventType.CHECKPOINT
    step: int | None = None
    epoch: int | None = None
    path: str | None = None
    saved_by: str | None = None
    seconds: float | None = None


class CheckpointDeletedEvent(Event):
    """`checkpoint_deleted`: the keep rules (checkpoint.keep_last / keep_best) removed `names`;
    `reason` when it was not the usual prune after a save (a full disk)."""
    type: Literal[EventType.CHECKPOINT_DELETED] = EventType.CHECKPOINT_DELETED
    step: int | None = None
    names: list[str] | None = None
    reason: str | None = None


class CheckpointFailedEvent(Event):
    """`checkpoint_failed`: nothing was published and the partial folder is gone. `error` names
    each failing rank; on a full disk (`disk_full`) `needed_bytes` (estimated from the previous
    checkpoint) and `free_bytes`, and `foreseen` when the save was not started at all."""
    type: Literal[EventType.CHECKPOINT_FAILED] = EventType.CHECKPOINT_FAILED
    path: str | None = None
    kind: str | None = None
    error: str | None = None
    disk_full: bool | None = None
    needed_bytes: int | None = None
    free_bytes: int | None = None
    foreseen: bool | None = None


class ResumeEvent(Event):
    type: Literal[EventType.RESUME] = EventType.RESUME
    checkpoint: str | None = None
    step: int | None = None
    epoch: int | None = None
    batch_in_epoch: int | None = None
    config_changes: list[str] | None = None  # the dotted config keys that differ from the checkpoint's
    seconds: float | None = None


class ExportEvent(Event):
    type: Literal[EventType.EXPORT] = EventType.EXPORT
    kind: str | None = None   # "model" or "adapter"
    path: str | None = None
    step: int | None = None
    seconds: float | None = None


class BestModelEvent(Event):
    """`best_model`: the weights of the checkpoint at `path` (step `step`), the best by `monitor`
    (its `value` there), were loaded at the end (checkpoint.load_best_at_end)."""
    type: Literal[EventType.BEST_MODEL] = EventType.BEST_MODEL
    path: str | None = None
    step: int | None = None
    monitor: str | None = None
    value: float | None = None


class _Restored(Event):
    """`rewind`: every rank loaded `target` (`source`: its checkpoint URL or "snapshot:<name>")
    in place. Training goes on from `step`; `abandoned` is [first, last] of the steps given up
    ([] when none), `from_step` the step before the rewind. `reason`: "user", or the guard's."""
    target: str | None = None
    source: str | None = None
    step: int | None = None
    from_step: int | None = None
    abandoned: list[int] | None = None
    branch: str | None = None
    reason: str | None = None
    epoch: int | None = None
    batch_in_epoch: int | None = None
    seconds: float | None = None


class RewindEvent(_Restored):
    type: Literal[EventType.REWIND] = EventType.REWIND


class BranchEvent(_Restored):
    """`branch`: as a rewind, then the run goes on as branch `branch`, child of `parent`, forked
    at `step`; `changes`: the settings the branch command changed. Events after it without a
    `branch` field belong to this branch (contract.branches)."""
    type: Literal[EventType.BRANCH] = EventType.BRANCH
    parent: str | None = None
    changes: dict[str, Any] | None = None


class SnapshotEvent(Event):
    """`snapshot`: `name` kept at `step` in host memory; `bytes` its size (every rank of this
    machine together), `kept` the names kept, `evicted` those dropped to make room, `total_bytes`
    what the kept ones take."""
    type: Literal[EventType.SNAPSHOT] = EventType.SNAPSHOT
    name: str | None = None
    step: int | None = None
    branch: str | None = None
    bytes: int | None = None
    total_bytes: int | None = None
    kept: list[str] | None = None
    evicted: list[str] | None = None
    seconds: float | None = None


class DataEvent(Event):
    """`data`: `change` is add / weight / remove / forget; `source` the source after it (name,
    path, format, weight, kind, samples, seen, scheduled), `sources` all live ones; add reports
    `report`, `dropped` and `dropped_rows` (row numbers and why); weight `before`; forget `id`."""
    type: Literal[EventType.DATA] = EventType.DATA
    step: int | None = None
    change: Literal["add", "weight", "remove", "forget"] | None = None
    source: dict[str, Any] | None = None
    sources: list[dict[str, Any]] | None = None
    applies_from_step: int | None = None
    report: str | None = None
    dropped: int | None = None
    dropped_rows: list[str] | None = None
    before: float | None = None
    id: str | None = None


class TeachEvent(Event):
    """`teach`: entry `id` (t1, t2 ...), `prompt` as the model saw it, `answer`, the greedy answer
    before (`old`), its rate (`per_step` samples in each of `steps` batches), `check_at_step`."""
    type: Literal[EventType.TEACH] = EventType.TEACH
    step: int | None = None
    id: str | None = None
    prompt: str | None = None
    answer: str | None = None
    old: str | None = None
    per_step: int | None = None
    steps: int | None = None
    check_at_step: int | None = None


class TeachCheckEvent(Event):
    """`teach_check`: the prompt asked again `steps` steps after `taught_at_step`: `old` and `new`
    greedy answers, `learned` when the new one is the taught `answer`."""
    type: Literal[EventType.TEACH_CHECK] = EventType.TEACH_CHECK
    step: int | None = None
    id: str | None = None
    prompt: str | None = None
    answer: str | None = None
    old: str | None = None
    new: str | None = None
    taught_at_step: int | None = None
    steps: int | None = None
    learned: bool | None = None


class WarningEvent(Event):
    """`warning`: `message` in words; a save foreseen not to fit names its `path`, `needed_bytes`
    and `free_bytes`."""
    type: Literal[EventType.WARNING] = EventType.WARNING
    message: str | None = None
    path: str | None = None
    needed_bytes: int | None = None
    free_bytes: int | None = None


class GuardEvent(Event):
    """`guard`: the spike guard judged step `step` bad. `trigger`: nonfinite_loss, loss_spike,
    grad_norm or nonfinite_grad_norm; `value` and `threshold` (non-finite numbers as strings);
    `action`: skip, rewind (then `target`, `target_step`, `lr_scale`; the `rewind` and `set`
    events follow), pause (a `state` paused follows) or none (reported only: `reason` says why);
    `reason` in words; `update_applied`: whether the step's update was applied before the guard
    judged it; `rewinds` / `max_rewinds` and `skips_in_a_row` after this action."""
    type: Literal[EventType.GUARD] = EventType.GUARD
    step: int | None = None
    trigger: str | None = None
    action: str | None = None
    reason: str | None = None
    value: float | str | None = None
    threshold: float | str | None = None
    update_applied: bool | None = None
    target: str | None = None
    target_step: int | None = None
    lr_scale: float | None = None
    rewinds: int | None = None
    max_rewinds: int | None = None
    skips_in_a_row: int | None = None


class EarlyStopEvent(Event):
    """`early_stop`: `metric` did not improve on `best` (by more than `threshold`) in `patience`
    evaluations in a row; the run ends after this step (the best checkpoint is loaded at the end
    when checkpoint.load_best_at_end)."""
    type: Literal[EventType.EARLY_STOP] = EventType.EARLY_STOP
    step: int | None = None
    metric: str | None = None
    value: float | None = None
    best: float | None = None
    best_step: int | None = None
    patience: int | None = None
    threshold: float | None = None


class RankFailedEvent(Event):
    """`rank_failed`: a rank of the group failed (`kind`: died, error, hung; `rank`; `error`: why,
    with its log's last lines) at `step`, and the run restarts (`restart` follows). A failure the
    run does not restart from is its final `state` failed event instead."""
    type: Literal[EventType.RANK_FAILED] = EventType.RANK_FAILED
    step: int | None = None
    rank: int | None = None
    kind: str | None = None
    error: str | None = None
    source: str | None = None


class RestartEvent(Event):
    """`restart`: the whole group relaunched (`attempt` of `max_restarts`) from `checkpoint` (the
    run folder's latest complete one, of step `step`), with the same folder, control file and inbox."""
    type: Literal[EventType.RESTART] = EventType.RESTART
    step: int | None = None
    attempt: int | None = None
    max_restarts: int | None = None
    checkpoint: str | None = None
    source: str | None = None


class SampleRow(BaseModel):
    """One sampled answer of a GRPO step: its `number` in the step (what `rate` names), its
    `group` (prompt), the data `row` (1-based), `prompt` (without special tokens) and `completion`
    (each cut to `SamplesEvent.text_limit` characters), each reward function's score (None where
    it did not score), the weighted `total` (None when none scored), its `advantage`, and whether
    it was `clipped` (cut at max_completion_length)."""
    model_config = ConfigDict(extra="allow")
    number: int
    group: int
    row: int | None = None
    prompt: str
    completion: str
    rewards: dict[str, float | None]
    total: float | None = None
    advantage: float
    clipped: bool


class SamplesEvent(Event):
    """`samples`: step `step`'s sampled answers (every rank's; the first `shown` of `count`, whole
    groups), the texts cut to `text_limit` characters (engine.objectives.grpo_samples)."""
    type: Literal[EventType.SAMPLES] = EventType.SAMPLES
    step: int | None = None
    samples: list[SampleRow] | None = None
    count: int | None = None
    text_limit: int | None = None


COMMAND_STATUSES = tuple(s.value for s in CommandStatus)

EVENT_MODELS: tuple[type[Event], ...] = (
    StateEvent, SetupEvent, TrainEvent, EvalEvent, CommandEvent, SetEvent, ChatPageEvent, CheckpointEvent,
    CheckpointDeletedEvent, CheckpointFailedEvent, ResumeEvent, ExportEvent, BestModelEvent, RewindEvent,
    BranchEvent, SnapshotEvent, DataEvent, TeachEvent, TeachCheckEvent, WarningEvent, GuardEvent,
    EarlyStopEvent, RankFailedEvent, RestartEvent, SamplesEvent)

AnyEvent = Annotated[Union[EVENT_MODELS], Field(discriminator="type")]  # type: ignore[valid-type]
EVENTS: TypeAdapter[Event] = TypeAdapter(AnyEvent)  # the one reader: `type` picks the model


class EventError(ValueError):
    """An event that does not match its model: names the type and each field at fault."""


def check_event(event: Event | dict[str, Any]) -> dict[str, Any]:
    """The JSON object of `event` (a model; or a dict, as a test replaying a log writes it)
    after checking it against the model of its type (EVENTS); EventError names what is wrong."""
    if isinstance(event, Event):
        return event.record()
    kind = event.get("type")
    if kind not in _TYPE_VALUES:
        raise EventError(f"event type {kind!r} is not one of contract.events.EventType")
    try:
        EVENTS.validate_python(event)
    except ValidationError as e:
        raise EventError(f"{EventType(kind).value} event: " + "; ".join(
            f"{'.'.join(map(str, err['loc'][1:]))}: {err['msg']}" for err in e.errors())) from None
    return {**event, "type": EventType(kind).value}  # the enum member written as its value


def parse_event(raw: dict[str, Any]) -> Event | None:
    """A read event as its model, or None for one that does not match it. An event of a type
    this version does not know is returned as a plain Event (readers ignore what they do not
    know: later versions may add types)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        return None
    if raw["type"] not in _TYPE_VALUES:
        return Event.model_construct(**raw)  # unknown type: kept as it is, unchecked
    try:
        return EVENTS.validate_python(raw)
    except ValidationError:
        return None


_TYPE_VALUES = frozenset(t.value for t in EventType)


def as_event(event: Event | dict[str, Any]) -> Event | None:
    """`event` as its model: a model as it is, a read JSON object through `parse_event` (None for
    one that does not match its model). The folds of a run's log take either."""
    return event if isinstance(event, Event) else parse_event(event)


# a train record's bookkeeping, not metrics ("line": the line number a reader may add)
_NOT_METRICS = frozenset(("type", "time", "branch", "step", "epoch", "total_steps", "line"))


def metric_numbers(event: TrainEvent | EvalEvent) -> dict[str, int | float]:
    """The numeric metrics of a `train` event (its declared numbers and the monitors' extra ones,
    less its step, epoch, total_steps and time), or of an `eval` event (its `eval/...` numbers),
    in the order the event holds them; bools are not numbers here."""
    # the declared fields, then the extra ones, read as iterating over the model gives them but
    # without its per-item overhead, and exact int / float first: a long run's log has a record
    # per step, and every front end folds it on a reattach
    extra = event.model_extra or {}
    if isinstance(event, EvalEvent):
        return {k: v for k, v in extra.items() if k[:5] == "eval/" and _number(v)}
    return {k: v for pairs in (event.__dict__, extra) for k, v in pairs.items()
            if (type(v) in _EXACT_NUMBERS or v is not None and _number(v)) and k not in _NOT_METRICS}


_EXACT_NUMBERS = frozenset((int, float))  # the common case, tested first: what JSON and validation give


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def state_event(state: RunState | str, **fields: Any) -> StateEvent:
    """A `state` event for `state` (checked against RunState), with `fields` (step, error, ...)."""
    return StateEvent(state=RunState(state), **fields)


def run_state(events: Any, default: RunState | None = None) -> RunState | None:
    """The state the last `state` event among `events` names (None or `default` without one)."""
    state = default
    for event in events:
        if event.get("type") == EventType.STATE and event.get("state") in _STATE_VALUES:
            state = RunState(event["state"])
    return state


_STATE_VALUES = frozenset(s.value for s in RunState)
