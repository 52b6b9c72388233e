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
The machinery they share is in contract.protocol.base, the branch commands in
contract.protocol.branch_commands and the data commands in contract.protocol.data_commands; everything is imported
through this module.

Commands are applied in order at the next step boundary, by every rank. `status` is answered at
once by rank 0 (rank 0's memory only); `status` with `ranks: true` waits for the boundary and
gathers every rank's memory. `subscribe` streams events.jsonl from line `from_line` (0-based),
then every new line as it is written: no gap, no duplicate. The events themselves are declared
in contract.events.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from contract.protocol.roles import Role
from contract.protocol.branch_commands import Branch, Branches, Rewind, Snapshot
from contract.protocol.base import Command, ProtocolError, _arg, _check_stop_strings, _Checked, check_messages
from contract.protocol.completion_commands import Complete
from contract.protocol.data_commands import AddSource, Forget, Inbox, RemoveSource, SetWeight, Teach
from contract.protocol.states import RunState

MAX_NEW_TOKENS = 4096


# the data commands: sources and the inbox of taught answers
DATA_COMMANDS = ("add_source", "set_weight", "remove_source", "teach", "inbox", "forget")

# The commands a front end may send in each state (status and subscribe are always answered while
# the run is live). `stop` while stopping ends the process group without waiting for the save.
ALLOWED_COMMANDS: dict[RunState, frozenset[str]] = {
    RunState.QUEUED: frozenset({"stop"}),  # no rank yet: Stop cancels the job (supervisor.slurm)
    RunState.STARTING: frozenset({"status", "stop"}),
    RunState.RUNNING: frozenset({"generate", "complete", "pause", "stop", "save", "evaluate", "set", "status",
                                 "rewind", "branch", "snapshot", "branches", *DATA_COMMANDS}),
    RunState.PAUSED: frozenset({"generate", "complete", "resume", "stop", "save", "evaluate", "set", "status",
                                "rewind", "branch", "snapshot", "branches", *DATA_COMMANDS}),
    RunState.STOPPING: frozenset({"status", "stop"}),
    RunState.FINISHED: frozenset(),
    RunState.FAILED: frozenset(),
}


def allowed_commands(state: RunState | str) -> frozenset[str]:
    """The commands allowed in `state` (a RunState or its string value)."""
    return ALLOWED_COMMANDS[RunState(state)]


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
    # base None: an unseeded sample draws a fresh seed and reports it (engine.generation.fresh_seed)
    seed: int | None = _arg(None, "Sampling seed; none: a fresh one each time, reported in the answer.",
                            base=None, minimum=0, maximum=2**63 - 1)

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
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
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


@dataclass(frozen=True)
class Status(Command):
    """The run now: step, state, last metrics, queue, settings and memory."""
    name: ClassVar[str] = "status"
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
    immediate: ClassVar[bool] = True  # unless `ranks`: see answered_at_once
    ranks: bool = _arg(False, "Gather every rank's memory at the next boundary (else rank 0's, at once).")

    @property
    def answered_at_once(self) -> bool:
        return not self.ranks


@dataclass(frozen=True)
class Subscribe(Command):
    """Stream events.jsonl from line `from_line` on, then each new line (answered at once)."""
    name: ClassVar[str] = "subscribe"
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
    immediate: ClassVar[bool] = True
    from_line: int = _arg(0, "First line (0-based) of events.jsonl to send.", minimum=0, maximum=2**63 - 1)


# the commands a run executes, by wire name (subscribe is a request for events, not a command)
COMMANDS: dict[str, type[Command]] = {c.name: c for c in (
    Generate, Pause, Resume, Stop, Save, Evaluate, Set, Status, Rewind, Branch, Snapshot, Branches,
    AddSource, SetWeight, RemoveSource, Teach, Inbox, Forget, Complete)}
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
