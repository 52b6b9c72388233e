"""The command/event protocol between front ends and rank 0. Torch-free; both sides import it.

Wire format: newline-delimited JSON over TCP on the run's control address; never pickle.

Client -> server, one object per line:
    {"token": "<run token>", "id": "<client-chosen id>", "cmd": "<command>", "args": {...}}
    {"token": ..., "id": ..., "cmd": "subscribe", "args": {"from_line": N}}   # events stream

Server -> client, one object per line, each tagged with the request id it belongs to:
    {"type": "ack",   "id": ..., "queued": <queue length>}      accepted, waits for a step boundary
    {"type": "token", "id": ..., "text": "...", "model": "current" | "base"}   streamed generation
    {"type": "done",  "id": ..., "result": {...}}               the command has taken effect
    {"type": "error", "id": ..., "message": "..."}              refused or failed; nothing changed
    {"type": "event", "line": N, "event": {...}}                an events.jsonl record (subscribers)

Each command is one frozen dataclass below (:class:`Generate`, :class:`Pause`, :class:`Resume`,
:class:`Stop`, :class:`Save`, :class:`Evaluate`, :class:`Set`, :class:`Status`, :class:`Rewind`,
:class:`Branch`, :class:`Snapshot`, :class:`Branches`, the data commands :class:`AddSource`,
:class:`SetWeight`, :class:`RemoveSource`, :class:`Teach`, :class:`Inbox`, :class:`Forget`, and the
:class:`Subscribe` request). Its fields are its arguments; their types, defaults, documentation
and bounds are declared there once, and validation, the wire form and every front end's
defaults (`Stop.save` is True everywhere) come from that declaration. Constructing a command
validates it; :func:`parse_command` turns a decoded message into one, `command.to_wire()` back.

Commands are applied in order at the next step boundary, by every rank. `status` is answered at
once by rank 0 (rank 0's memory only); `status` with `ranks: true` waits for the boundary and
gathers every rank's memory. `subscribe` streams events.jsonl from line `from_line` (0-based),
then every new line as it is written: no gap, no duplicate. The events themselves are declared
in contract.events.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Self, Union

MAX_MESSAGE_BYTES = 1 << 20  # a longer line is refused, never buffered without bound
MAX_NEW_TOKENS = 4096
_ROLES = ("system", "user", "assistant")


class RunState(str, Enum):
    """A run's state, as written in `state` events; the one definition every part uses."""
    QUEUED = "queued"        # submitted to a scheduler (Slurm), waiting for its resources
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        """The run is over; nothing can be asked of it any more."""
        return self in (RunState.FINISHED, RunState.FAILED)

    @property
    def live(self) -> bool:
        return not self.final


STATES = tuple(s.value for s in RunState)
# the data commands (issue 13): sources and the inbox of taught answers
DATA_COMMANDS = ("add_source", "set_weight", "remove_source", "teach", "inbox", "forget")

# The commands a front end may send in each state (status and subscribe are always answered while
# the run is live). `stop` while stopping ends the process group without waiting for the save.
ALLOWED_COMMANDS: dict[RunState, frozenset[str]] = {
    RunState.QUEUED: frozenset({"stop"}),  # no rank yet: Stop cancels the job (supervisor.slurm)
    RunState.STARTING: frozenset({"status", "stop"}),
    RunState.RUNNING: frozenset({"generate", "pause", "stop", "save", "evaluate", "set", "status",
                                 "rewind", "branch", "snapshot", "branches", *DATA_COMMANDS}),
    RunState.PAUSED: frozenset({"generate", "resume", "stop", "save", "evaluate", "set", "status",
                                "rewind", "branch", "snapshot", "branches", *DATA_COMMANDS}),
    RunState.STOPPING: frozenset({"status", "stop"}),
    RunState.FINISHED: frozenset(),
    RunState.FAILED: frozenset(),
}


def allowed_commands(state: RunState | str) -> frozenset[str]:
    """The commands allowed in `state` (a RunState or its string value)."""
    return ALLOWED_COMMANDS[RunState(state)]


class ProtocolError(ValueError):
    """A message or command that breaks the protocol; the text names the field at fault."""


def _arg(default: Any, help: str, **meta: Any) -> Any:
    """A command argument: its default, its documentation and its bounds (minimum, maximum,
    exclusive_minimum) in one declaration. `base`: the run's own default where the argument's
    default is None (\"the run's setting\")."""
    return field(default=default, metadata={"help": help, **meta})


# -- validation, driven by the dataclass declarations ------------------------------------------
class _Checked:
    """Validates a dataclass's fields against their declared types and bounds on construction."""

    label: ClassVar[str] = ""  # how errors name the thing (the command's name)

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue  # not given: the run's setting applies
            value = _checked_type(self.label, f.name, value, hints[f.name])
            object.__setattr__(self, f.name, value)
            _check_bounds(self.label, f.name, value, f.metadata)
        self._check()

    def _check(self) -> None:
        """Rules between fields (a subclass adds them)."""

    @classmethod
    def from_args(cls, args: Any, label: str | None = None) -> Self:
        """Build from a wire `args` object: unknown names and explicit nulls are refused."""
        label = label or cls.label
        if not isinstance(args, dict):
            raise ProtocolError(f"{label}: the arguments must be an object")
        hints, names = _hints(cls), [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        values = {}
        for key, value in args.items():
            if key not in names:
                raise ProtocolError(f"{label}: unknown argument {key!r}; allowed: {', '.join(names) or 'none'}")
            nested = _nested(hints[key])
            if nested is not None and isinstance(value, dict):
                value = nested.from_args(value, f"{label} {key}")
            elif value is None:
                raise ProtocolError(f"{label}: argument {key!r} has the wrong type (NoneType)")
            values[key] = value
        return cls(**values)

    def given(self) -> dict[str, Any]:
        """The arguments that were given (not None), nested ones as plain dicts: the wire form."""
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value.given() if isinstance(value, _Checked) else value
        return out


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _nested(hint: Any) -> Any:
    """The dataclass a field holds (`Set.generation`), if it holds one."""
    for t in typing.get_args(hint) or (hint,):
        if isinstance(t, type) and not typing.get_args(t) and issubclass(t, _Checked):
            return t
    return None


def _checked_type(label: str, name: str, value: Any, hint: Any) -> Any:
    """`value` if it has the declared type (an int given for a float becomes a float)."""
    kinds = [t for t in (typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,))
             if t is not type(None)]
    for kind in kinds:
        base = typing.get_origin(kind) or kind
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # a 400-digit integer: no float holds it
                raise ProtocolError(f"{label}: argument {name!r} is too large ({len(str(value))} "
                                    f"digits)") from None
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base is not int and base is not float and isinstance(value, base):
            return value
    raise ProtocolError(f"{label}: argument {name!r} has the wrong type ({type(value).__name__})")


def _check_bounds(label: str, name: str, value: Any, meta: Any) -> None:
    if "minimum" not in meta or isinstance(value, bool):
        return
    lo, hi, lo_ok = meta["minimum"], meta["maximum"], not meta.get("exclusive_minimum", False)
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float (a 400-digit number) is out of range
        finite = False
    if not finite or value > hi or value < lo or (value == lo and not lo_ok):
        low = f">= {lo}" if lo_ok else f"> {lo}"
        raise ProtocolError(f"{label}: argument {name!r} must be {low} and <= {hi}, got {value}")


def _check_stop_strings(label: str, stop: list | None) -> None:
    if stop is not None and not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError(f"{label}: argument 'stop' must be a list of non-empty strings")


def check_messages(messages: list) -> None:
    """A chat: a non-empty list of {"role": system|user|assistant, "content": str}."""
    if not messages:
        raise ProtocolError("generate: `messages` must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or \
                m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise ProtocolError(f"generate: messages[{i}] must be {{\"role\": one of {', '.join(_ROLES)}, "
                                f"\"content\": a string}}")


# -- the commands ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Command(_Checked):
    """A request to the run. `name` is its wire name; `to_wire()` its {"cmd", "args"} form."""

    name: ClassVar[str] = ""
    # answered by rank 0 at once, without waiting for a step boundary
    immediate: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            cls.label = cls.name  # errors name the command they refuse

    def args(self) -> dict[str, Any]:
        """The wire arguments: every argument that was given (None ones are left out)."""
        return self.given()

    def to_wire(self) -> dict[str, Any]:
        return {"cmd": self.name, "args": self.args()}

    @property
    def answered_at_once(self) -> bool:
        """Rank 0 answers it from its server thread, without a step boundary."""
        return self.immediate


@dataclass(frozen=True)
class GenerationParams(_Checked):
    """Sampling parameters. None: the run's default, which `set generation={...}` changes and
    which starts at each field's `base` (GENERATION_DEFAULTS)."""

    label: ClassVar[str] = "set generation"
    max_new_tokens: int | None = _arg(None, "Most tokens to generate.", base=64,
                                      minimum=1, maximum=MAX_NEW_TOKENS)
    temperature: float | None = _arg(None, "Sampling temperature; 0 is greedy.", base=0.0,
                                     minimum=0.0, maximum=100.0)
    top_p: float | None = _arg(None, "Nucleus sampling: keep the most likely tokens up to this "
                               "probability mass.", base=1.0, minimum=0.0, maximum=1.0,
                               exclusive_minimum=True)
    top_k: int | None = _arg(None, "Keep only the k most likely tokens; 0: all.", base=0,
                             minimum=0, maximum=1 << 20)
    repetition_penalty: float | None = _arg(None, "Penalty on tokens already generated; 1: none.",
                                            base=1.0, minimum=0.0, maximum=100.0, exclusive_minimum=True)
    stop: list[str] | None = _arg(None, "Strings that end the answer.", base=())
    seed: int | None = _arg(None, "Sampling seed.", base=0, minimum=0, maximum=2**63 - 1)

    def _check(self) -> None:
        _check_stop_strings(self.label, self.stop)

    def sampling(self) -> dict[str, Any]:
        """The generation parameters given here (not None), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GenerationParams)
                if getattr(self, f.name) is not None}


GENERATION_PARAMS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GenerationParams))
# what a chat request gets when neither it nor `set generation` says otherwise
GENERATION_DEFAULTS: dict[str, Any] = {
    f.name: list(f.metadata["base"]) if isinstance(f.metadata["base"], tuple) else f.metadata["base"]
    for f in dataclasses.fields(GenerationParams)}


@dataclass(frozen=True)
class Generate(GenerationParams, Command):
    """Answer `prompt` (continued as is) or chat `messages` (through the model's chat template)
    with the live weights, streamed token by token."""

    name: ClassVar[str] = "generate"
    prompt: str | None = _arg(None, "Text the model continues (give this or `messages`).")
    messages: list[dict[str, str]] | None = _arg(
        None, "A chat: [{role: system|user|assistant, content}] (give this or `prompt`).")
    compare_base: bool = _arg(False, "Also answer with the PEFT adapter disabled (the base model).")

    def _check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("generate: give exactly one of `prompt` or `messages`")
        if self.messages is not None:
            check_messages(self.messages)
        super()._check()


@dataclass(frozen=True)
class Pause(Command):
    """Hold training at the next step boundary; everything stays in memory."""
    name: ClassVar[str] = "pause"


@dataclass(frozen=True)
class Resume(Command):
    """Go on training after a pause."""
    name: ClassVar[str] = "resume"


@dataclass(frozen=True)
class Stop(Command):
    """End the run at the next step boundary."""
    name: ClassVar[str] = "stop"
    save: bool = _arg(True, "Save a training checkpoint now and the final model at the end; "
                      "false: neither (whatever checkpoint.save_at_end says).")


@dataclass(frozen=True)
class Save(Command):
    """Write a training checkpoint of the present step."""
    name: ClassVar[str] = "save"


@dataclass(frozen=True)
class Evaluate(Command):
    """Run the evaluation now."""
    name: ClassVar[str] = "evaluate"


@dataclass(frozen=True)
class Set(Command):
    """Change live settings; all or nothing, recorded as a `set` event and in checkpoints."""
    name: ClassVar[str] = "set"
    lr: float | None = _arg(None, "Learning rate from the next step on (the schedule goes on, scaled).",
                            minimum=0.0, maximum=10.0)
    lr_scale: float | None = _arg(None, "Factor on the configured schedule's learning rate.",
                                  minimum=0.0, maximum=1e6, exclusive_minimum=True)
    grad_clip: float | None = _arg(None, "Gradient clipping norm; 0: off.", minimum=0.0, maximum=1e9)
    eval_every_n_steps: int | None = _arg(None, "Evaluate every n steps; 0: off.", minimum=0, maximum=2**31)
    save_every_n_steps: int | None = _arg(None, "Checkpoint every n steps; 0: off.", minimum=0, maximum=2**31)
    generation: GenerationParams | None = _arg(None, "New defaults of chat requests.")

    def _check(self) -> None:
        if not self.given():
            names = ", ".join(f.name for f in dataclasses.fields(self))
            raise ProtocolError(f"set: name at least one of {names}")


def _check_target(label: str, target: str) -> None:
    if not target.strip():
        raise ProtocolError(f"{label}: argument 'target' must name a checkpoint (step-40), a step "
                            "number (40) or a snapshot")


@dataclass(frozen=True)
class Rewind(Command):
    """Go back, in place, to a checkpoint or snapshot of this run: every rank loads it into the
    running engines (model, optimizer, scheduler, data position, RNGs, live settings) and
    training goes on from there on the same branch; the steps after it are abandoned."""
    name: ClassVar[str] = "rewind"
    target: str = _arg("", "The checkpoint (step-40, or 40: that step's checkpoint of the present "
                       "branch, else of an ancestor) or a snapshot's name.")

    def _check(self) -> None:
        _check_target(self.label, self.target)


@dataclass(frozen=True)
class Branch(Command):
    """Rewind to `target` and go on as a new branch `name` (the present branch stays as it is and
    can be branched from later), optionally with changed settings."""
    name: ClassVar[str] = "branch"
    target: str = _arg("", "The checkpoint or snapshot the branch starts from (as rewind's).")
    branch: str = _arg("", "The new branch's name (letters, digits, - _ .; unique in the run).")
    lr: float | None = _arg(None, "Learning rate of the branch's first step (as set).", minimum=0.0, maximum=10.0)
    lr_scale: float | None = _arg(None, "Factor on the configured schedule (as set).",
                                  minimum=0.0, maximum=1e6, exclusive_minimum=True)
    grad_clip: float | None = _arg(None, "Gradient clipping norm; 0: off.", minimum=0.0, maximum=1e9)
    eval_every_n_steps: int | None = _arg(None, "Evaluate every n steps; 0: off.", minimum=0, maximum=2**31)
    save_every_n_steps: int | None = _arg(None, "Checkpoint every n steps; 0: off.", minimum=0, maximum=2**31)

    def _check(self) -> None:
        _check_target(self.label, self.target)
        from contract.branches import check_name  # the one rule for names (torch-free, ours)
        try:
            check_name(self.branch, "branch")
        except ValueError as e:
            raise ProtocolError(f"branch: {e}") from None

    def settings(self) -> dict[str, Any]:
        """The settings the branch changes, as `set` arguments."""
        return {k: v for k, v in self.given().items() if k not in ("target", "branch")}


@dataclass(frozen=True)
class Snapshot(Command):
    """Keep the complete training state in host memory now, for an instant rewind (bounded by
    checkpoint.snapshots_keep / snapshots_max_mib; the oldest goes first)."""
    name: ClassVar[str] = "snapshot"
    # `snapshot`, not `name`: `name` is every command's wire name
    snapshot: str | None = _arg(None, "The snapshot's name (unique among those kept); default snap-<step>.")

    def _check(self) -> None:
        if self.snapshot is not None:
            from contract.branches import check_name
            try:
                check_name(self.snapshot, "snapshot")
            except ValueError as e:
                raise ProtocolError(f"snapshot: {e}") from None


@dataclass(frozen=True)
class Branches(Command):
    """The run's branch tree, the present branch, its checkpoints and the snapshots in memory."""
    name: ClassVar[str] = "branches"


# -- data commands (issue 13): the run's sources and the inbox of taught answers ----------------
_FORMATS = ("auto", "text", "input_output", "chat", "tokenized")


def _check_source_name(label: str, source: str, required: bool = True) -> None:
    if (required and not source.strip()) or source != source.strip() or "/" in source:
        raise ProtocolError(f"{label}: argument 'source' must name a source (no '/', no surrounding "
                            f"spaces), got {source!r}")


@dataclass(frozen=True)
class AddSource(Command):
    """Add a training source at the next step boundary: its rows are read and checked like the
    data at start (bad rows are reported by number; an unusable file is refused, nothing changes)."""
    name: ClassVar[str] = "add_source"
    path: str = _arg("", "The file or saved dataset folder (as data.train takes).")
    format: str = _arg("auto", "Row format: auto, text, input_output, chat or tokenized.")
    weight: float = _arg(1.0, "Its weight among the sources (0: added paused).", minimum=0.0, maximum=1e9)
    # `source`, not `name`: `name` is every command's wire name
    source: str = _arg("", "The source's name; default: the file name without its suffix.")

    def _check(self) -> None:
        if not self.path.strip():
            raise ProtocolError("add_source: argument 'path' must name a file or folder")
        if self.format not in _FORMATS:
            raise ProtocolError(f"add_source: argument 'format' must be one of {', '.join(_FORMATS)}, "
                                f"got {self.format!r}")
        _check_source_name(self.label, self.source, required=False)


@dataclass(frozen=True)
class SetWeight(Command):
    """Change a source's weight from the next step on; 0 pauses it."""
    name: ClassVar[str] = "set_weight"
    source: str = _arg("", "The source's name.")
    weight: float = _arg(1.0, "Its new weight (0 pauses it).", minimum=0.0, maximum=1e9)

    def _check(self) -> None:
        _check_source_name(self.label, self.source)


@dataclass(frozen=True)
class RemoveSource(Command):
    """Stop drawing from a source from the next step on (its position stays in the record)."""
    name: ClassVar[str] = "remove_source"
    source: str = _arg("", "The source's name.")

    def _check(self) -> None:
        _check_source_name(self.label, self.source)


@dataclass(frozen=True)
class Teach(Command):
    """Append (the prompt as the model saw it, the corrected answer) to the run's inbox, durably,
    and mix it into the next batches: `per_step` samples in each of the next `steps` batches
    (teach.* in the config by default), and/or the inbox source's `weight`."""
    name: ClassVar[str] = "teach"
    answer: str = _arg("", "The answer the model should have given.")
    prompt: str | None = _arg(None, "The prompt, as given to generate (give this or `messages`).")
    messages: list[dict[str, str]] | None = _arg(None, "The chat the answer continues (give this or `prompt`).")
    per_step: int | None = _arg(None, "Samples of it per global batch (default teach.per_step).",
                                minimum=0, maximum=1 << 20)
    steps: int | None = _arg(None, "Batches it is mixed into (default teach.steps).", minimum=0, maximum=1 << 20)
    check_after: int | None = _arg(None, "Steps until the model is asked again (default "
                                   "teach.check_after; 0: never).", minimum=0, maximum=1 << 20)
    weight: float | None = _arg(None, "The inbox source's weight from now on (all its entries, "
                                "round robin); default: left as it is (0 at first).", minimum=0.0, maximum=1e9)

    def _check(self) -> None:
        if not self.answer.strip():
            raise ProtocolError("teach: argument 'answer' is empty; write the answer the model should have given")
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("teach: give exactly one of `prompt` or `messages`")
        if self.prompt is not None and not self.prompt:
            raise ProtocolError("teach: argument 'prompt' is empty")
        if self.messages is not None:
            check_messages(self.messages)


@dataclass(frozen=True)
class Inbox(Command):
    """The run's inbox: every taught entry, forgotten ones marked."""
    name: ClassVar[str] = "inbox"


@dataclass(frozen=True)
class Forget(Command):
    """Stop training on an inbox entry from the next step on (the file keeps a record of it)."""
    name: ClassVar[str] = "forget"
    id: str = _arg("", "The entry's id (t1, t2, ...; see inbox).")

    def _check(self) -> None:
        if not self.id.strip():
            raise ProtocolError("forget: argument 'id' must name an inbox entry (t1, t2, ...)")


@dataclass(frozen=True)
class Status(Command):
    """The run now: step, state, last metrics, queue, settings and memory."""
    name: ClassVar[str] = "status"
    immediate: ClassVar[bool] = True  # unless `ranks`: see answered_at_once
    ranks: bool = _arg(False, "Gather every rank's memory at the next boundary (else rank 0's, at once).")

    @property
    def answered_at_once(self) -> bool:
        return not self.ranks


@dataclass(frozen=True)
class Subscribe(Command):
    """Stream events.jsonl from line `from_line` on, then each new line (answered at once)."""
    name: ClassVar[str] = "subscribe"
    immediate: ClassVar[bool] = True
    from_line: int = _arg(0, "First line (0-based) of events.jsonl to send.", minimum=0, maximum=2**63 - 1)


# the commands a run executes, by wire name (subscribe is a request for events, not a command)
COMMANDS: dict[str, type[Command]] = {c.name: c for c in (
    Generate, Pause, Resume, Stop, Save, Evaluate, Set, Status, Rewind, Branch, Snapshot, Branches,
    AddSource, SetWeight, RemoveSource, Teach, Inbox, Forget)}
REQUESTS: dict[str, type[Command]] = {**COMMANDS, Subscribe.name: Subscribe}
# the requests rank 0 may answer from its server thread (status only without `ranks`)
IMMEDIATE = frozenset(name for name, c in REQUESTS.items() if c.immediate)


def command_from_wire(cmd: Any, args: Any) -> Command:
    """The command named `cmd` with wire arguments `args`, validated."""
    if not isinstance(cmd, str) or cmd not in REQUESTS:
        raise ProtocolError(f"unknown command {cmd!r}; allowed: {', '.join(sorted(COMMANDS))}, subscribe")
    return REQUESTS[cmd].from_args(args)


def parse_command(msg: Any) -> tuple[str, Command]:
    """Validate a decoded client message (the token is checked elsewhere); returns
    (request id, command)."""
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    req_id, args = msg.get("id"), msg.get("args", {})
    if not isinstance(req_id, (str, int)) or isinstance(req_id, bool):
        raise ProtocolError("field `id` must be a string or integer")
    if not isinstance(args, dict):
        raise ProtocolError("field `args` must be an object")
    return str(req_id), command_from_wire(msg.get("cmd"), args)


def check_command(msg: Any) -> tuple[str, str, dict]:
    """The older form of :func:`parse_command`: (id, command name, wire arguments).
    Kept until the control server has moved to parse_command."""
    req_id, command = parse_command(msg)
    return req_id, command.name, command.args()


# -- bytes on the wire ---------------------------------------------------------------------------
def encode(obj: dict) -> bytes:
    return (json.dumps(obj, default=jsonable) + "\n").encode()


def jsonable(value: Any) -> Any:
    """Numbers from numpy / torch as plain numbers, anything else JSON cannot hold as text."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def decode(line: bytes) -> Any:
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message larger than {MAX_MESSAGE_BYTES} bytes")
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed JSON: {e}") from None
