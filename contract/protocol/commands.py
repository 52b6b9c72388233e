"""The command/event protocol between front ends and rank 0. Torch-free; both sides import it.

Wire format: newline-delimited JSON over TCP on the run's control address; never pickle.

Client -> server, one object per line:
    {"token": "<run token>", "id": "<client-chosen id>", "cmd": "<command>", "args": {...}}
    {"token": ..., "id": ..., "cmd": "subscribe", "args": {"from_line": N}}   # events stream

Server -> client, one object per line, each tagged with the request id it belongs to:
    {"type": "ack",   "id": ..., "queued": <queue length>}      accepted, waits for a step boundary
    {"type": "token", "id": ..., "text": "...", "model": "current" | "base"}   streamed generation
                                                                (`complete`'s also "step", "seed")
    {"type": "done",  "id": ..., "result": {...}}               the command has taken effect
    {"type": "error", "id": ..., "message": "..."}              refused or failed; nothing changed
    {"type": "event", "line": N, "event": {...}}                an events.jsonl record (subscribers)

Each command is one frozen pydantic model (:class:`Generate`, :class:`Pause`, :class:`Resume`,
:class:`Stop`, :class:`Save`, :class:`Evaluate`, :class:`Set`, :class:`Status`, :class:`Subscribe`
below; :class:`Rewind`, :class:`Branch`, :class:`Snapshot`, :class:`Branches` in
contract.protocol.branch_commands; the data commands :class:`AddSource`, :class:`SetWeight`,
:class:`RemoveSource`, :class:`Teach`, :class:`Inbox`, :class:`Forget` in
contract.protocol.data_commands; :class:`Complete` in contract.protocol.completion_commands). Its
fields are its arguments: type, default, description and bounds declared once with pydantic's
`Field`, and validation, the wire form, the JSON schema (`Set.model_json_schema()`) and every
front end's defaults (`Stop().save` is True everywhere) come from that declaration. Constructing
a command validates it; :func:`parse_command` validates a decoded message through one pydantic
discriminated union on `cmd`, and `command.to_wire()` gives the message back. What they share
(the base model, the error words) is in contract.protocol.base.

Commands are applied in order at the next step boundary, by every rank. `status` is answered at
once by rank 0 (rank 0's memory only); `status` with `ranks: true` waits for the boundary and
gathers every rank's memory. `subscribe` streams events.jsonl from line `from_line` (0-based),
then every new line as it is written: no gap, no duplicate. The events themselves are declared
in contract.events.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import Field, TypeAdapter, ValidationError, create_model, field_validator, model_validator

from contract.protocol.answers import (Answer, EvaluateAnswer, GenerateAnswer, SaveAnswer, SetAnswer, StateAnswer,
                                       StatusAnswer, StopAnswer)
from contract.protocol.roles import Role
from contract.protocol.branch_commands import Branch, Branches, Rewind, Snapshot
from contract.protocol.base import WIRE, Arguments, Chat, Command, ProtocolError, StopStrings, in_words
from contract.config.schema import GrpoConfig
from contract.protocol.completion_commands import Complete
from contract.protocol.data_commands import AddSource, Forget, Inbox, RemoveSource, SetWeight, Teach
from contract.protocol.rating_commands import Rate, RateChat
from contract.protocol.reward_commands import AddReward, RemoveReward
from contract.protocol.states import RunState

MAX_NEW_TOKENS = 4096


# the data commands: sources and the inbox of taught answers; a GRPO run's reward functions
DATA_COMMANDS = ("add_source", "set_weight", "remove_source", "teach", "inbox", "forget", "add_reward",
                 "remove_reward")

# The commands a front end may send in each state (status and subscribe are always answered while
# the run is live). `stop` while stopping ends the process group without waiting for the save.
ALLOWED_COMMANDS: dict[RunState, frozenset[str]] = {
    RunState.QUEUED: frozenset({"stop"}),  # no rank yet: Stop cancels the job (supervisor.slurm)
    RunState.STARTING: frozenset({"status", "stop"}),
    RunState.RUNNING: frozenset({"generate", "complete", "pause", "stop", "save", "evaluate", "set", "status",
                                 "rewind", "branch", "snapshot", "branches", *DATA_COMMANDS, "rate", "rate_chat"}),
    RunState.PAUSED: frozenset({"generate", "complete", "resume", "stop", "save", "evaluate", "set", "status",
                                "rewind", "branch", "snapshot", "branches", *DATA_COMMANDS, "rate", "rate_chat"}),
    RunState.STOPPING: frozenset({"status", "stop"}),
    RunState.FINISHED: frozenset(),
    RunState.FAILED: frozenset(),
}


def allowed_commands(state: RunState | str) -> frozenset[str]:
    """The commands allowed in `state` (a RunState or its string value)."""
    return ALLOWED_COMMANDS[RunState(state)]


def _run_default(value: Any) -> Any:
    """The run's default of a generation parameter (until `set generation` changes it)."""
    return {"run_default": value}


class GenerationParams(Arguments):
    """Sampling parameters. None: the run's default, which `set generation={...}` changes and
    which starts at each field's `run_default` (GENERATION_DEFAULTS)."""

    label: ClassVar[str] = "set generation"
    max_new_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS, description="Most tokens to generate.",
                                       json_schema_extra=_run_default(64))
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, description="Sampling temperature; 0 is greedy.",
                                      json_schema_extra=_run_default(0.0))
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling: keep the most likely "
                                "tokens up to this probability mass.", json_schema_extra=_run_default(1.0))
    top_k: int | None = Field(default=None, ge=0, le=1 << 20, description="Keep only the k most likely tokens; 0: all.",
                              json_schema_extra=_run_default(0))
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0, description="Penalty on tokens already "
                                             "generated; 1: none.", json_schema_extra=_run_default(1.0))
    stop: StopStrings | None = Field(default=None, description="Strings that end the answer.",
                                     json_schema_extra=_run_default([]))
    # run default None: an unseeded sample draws a fresh seed and reports it (engine.generation.generate.fresh_seed)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, description="Sampling seed; none: a fresh one each "
                             "time, reported in the answer.", json_schema_extra=_run_default(None))

    def sampling(self) -> dict[str, Any]:
        """The generation parameters given here (not None), by name."""
        return self.model_dump(include=set(GENERATION_PARAMS), exclude_none=True)


GENERATION_PARAMS: tuple[str, ...] = tuple(GenerationParams.model_fields)
# what a chat request gets when neither it nor `set generation` says otherwise
GENERATION_DEFAULTS: dict[str, Any] = {
    name: copy.deepcopy(f.json_schema_extra["run_default"])  # type: ignore[index]
    for name, f in GenerationParams.model_fields.items()}


class Generate(GenerationParams, Command):
    """Answer `prompt` (continued as is) or chat `messages` (through the model's chat template)
    with the live weights, streamed token by token."""

    name: ClassVar[str] = "generate"
    returns: ClassVar[type[Answer]] = GenerateAnswer
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
    prompt: str | None = Field(default=None, description="Text the model continues (give this or `messages`).")
    messages: Chat | None = Field(default=None, description="A chat: [{role: system|user|assistant, content}] "
                                  "(give this or `prompt`).")
    compare_base: bool = Field(default=False, description="Also answer with the PEFT adapter disabled (the base "
                               "model).")

    @model_validator(mode="after")
    def _prompt_or_chat(self) -> Generate:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` or `messages`")
        return self


class Pause(Command):
    """Hold training at the next step boundary; everything stays in memory."""
    name: ClassVar[str] = "pause"
    returns: ClassVar[type[Answer]] = StateAnswer


class Resume(Command):
    """Go on training after a pause."""
    name: ClassVar[str] = "resume"
    returns: ClassVar[type[Answer]] = StateAnswer


class Stop(Command):
    """End the run at the next step boundary."""
    name: ClassVar[str] = "stop"
    returns: ClassVar[type[Answer]] = StopAnswer
    save: bool = Field(default=True, description="Save a training checkpoint now and the final model at the end; "
                       "false: neither (whatever checkpoint.save_at_end says).")


class Save(Command):
    """Write a training checkpoint of the present step."""
    name: ClassVar[str] = "save"
    returns: ClassVar[type[Answer]] = SaveAnswer


class Evaluate(Command):
    """Run the evaluation now."""
    name: ClassVar[str] = "evaluate"
    returns: ClassVar[type[Answer]] = EvaluateAnswer


# the GRPO settings `set` changes (each `grpo_<name>`, with GrpoConfig's bounds and help)
GRPO_SETTINGS = ("temperature", "top_p", "num_generations", "max_completion_length", "beta", "epsilon")


def _grpo_setting(name: str) -> Any:
    """Set's field for grpo.<name>: the config field's bounds and description, declared once there."""
    field = GrpoConfig.model_fields[name]
    bounds = {k: getattr(m, k) for m in field.metadata for k in ("ge", "le") if getattr(m, k, None) is not None}
    return Field(default=None, description=f"A GRPO run's grpo.{name}: {field.description}", **bounds)


class Set(Command):
    """Change live settings; all or nothing, recorded as a `set` event and in checkpoints."""
    name: ClassVar[str] = "set"
    returns: ClassVar[type[Answer]] = SetAnswer
    lr: float | None = Field(default=None, ge=0.0, le=10.0, description="Learning rate from the next step on (the "
                             "schedule goes on, scaled).")
    lr_scale: float | None = Field(default=None, gt=0.0, le=1e6, description="Factor on the configured schedule's "
                                   "learning rate.")
    grad_clip: float | None = Field(default=None, ge=0.0, le=1e9, description="Gradient clipping norm; 0: off.")
    eval_every_n_steps: int | None = Field(default=None, ge=0, le=2**31, description="Evaluate every n steps; 0: off.")
    save_every_n_steps: int | None = Field(default=None, ge=0, le=2**31, description="Checkpoint every n steps; "
                                           "0: off.")
    generation: GenerationParams | None = Field(default=None, description="New defaults of chat requests.")
    # the optimizer's parameter groups (torch's rules for Adam; the engine refuses a field the
    # run's optimizer does not have, and checks `optimizer` fields with that optimizer's own rules)
    weight_decay: float | None = Field(default=None, ge=0.0, le=1e3, description="Weight decay of the parameter "
                                       "groups that decay (biases and norm weights keep 0).")
    betas: list[float] | None = Field(default=None, min_length=2, max_length=2, description="Adam's two betas, "
                                     "each in [0, 1).")
    eps: float | None = Field(default=None, gt=0.0, le=1.0, description="Adam's epsilon (above 0).")
    optimizer: dict[str, float | bool | list[float]] | None = Field(
        default=None, description="Any other field of the optimizer's parameter groups by name (e.g. momentum "
        "for SGD), checked by the optimizer's own rules.")
    preference_beta: float | None = Field(default=None, gt=0.0, le=1e3, description="The preference objective's "
                                          "beta (DPO, SimPO, KTO; an SFT run's live pairs).")
    serving_budget: float | None = Field(default=None, ge=0.0, le=1.0, description="Share of the training time the "
                                         "OpenAI-compatible API's requests may take (control.serving_budget).")
    # a GRPO run's (engine.objectives.grpo_live): any other run refuses them, naming the field
    reward_weights: dict[str, float] | None = Field(default=None, description="A GRPO run's reward weights by "
                                                    "reward name (the reward is their weighted sum).")
    grpo_temperature: float | None = _grpo_setting("temperature")
    grpo_top_p: float | None = _grpo_setting("top_p")
    grpo_num_generations: int | None = _grpo_setting("num_generations")
    grpo_max_completion_length: int | None = _grpo_setting("max_completion_length")
    grpo_beta: float | None = _grpo_setting("beta")
    grpo_epsilon: float | None = _grpo_setting("epsilon")

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: list[float] | None) -> list[float] | None:
        # torch's rule for Adam's betas: 0 <= beta < 1, each
        if betas is not None and not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"argument 'betas' must be two numbers each in [0, 1), got {betas}")
        return betas

    @model_validator(mode="after")
    def _something(self) -> Set:
        if not self.args():
            raise ValueError(f"name at least one of {', '.join(type(self).model_fields)}")
        return self


class Status(Command):
    """The run now: step, state, last metrics, queue, settings and memory."""
    name: ClassVar[str] = "status"
    returns: ClassVar[type[Answer]] = StatusAnswer
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
    immediate: ClassVar[bool] = True  # unless `ranks`: see answered_at_once
    ranks: bool = Field(default=False, description="Gather every rank's memory at the next boundary (else rank 0's, "
                        "at once).")

    @property
    def answered_at_once(self) -> bool:
        return not self.ranks


class Subscribe(Command):
    """Stream events.jsonl from line `from_line` on, then each new line (answered at once)."""
    name: ClassVar[str] = "subscribe"
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
    immediate: ClassVar[bool] = True
    from_line: int = Field(default=0, ge=0, le=2**63 - 1, description="First line (0-based) of events.jsonl to send.")


# the commands a run executes, by wire name (subscribe is a request for events, not a command)
COMMANDS: dict[str, type[Command]] = {c.name: c for c in (
    Generate, Pause, Resume, Stop, Save, Evaluate, Set, Status, Rewind, Branch, Snapshot, Branches,
    AddSource, SetWeight, RemoveSource, Teach, Inbox, Forget, Complete, Rate, RateChat, AddReward, RemoveReward)}
REQUESTS: dict[str, type[Command]] = {**COMMANDS, Subscribe.name: Subscribe}
# the requests rank 0 may answer from its server thread (status only without `ranks`)
IMMEDIATE = frozenset(name for name, c in REQUESTS.items() if c.immediate)

# A message's {"cmd", "args"}: a union of one model per request, told apart by `cmd` (pydantic's
# discriminated union), whose `args` is that request's arguments.
# (the request classes are known only here, at run time: a type checker cannot follow them)
_MESSAGES = tuple(create_model(f"{c.__name__}Message", cmd=(Literal[c.name], ...),  # type: ignore[valid-type, arg-type]
                               args=(c, ...)) for c in REQUESTS.values())
_MESSAGE: TypeAdapter[Any] = TypeAdapter(
    Annotated[Union[_MESSAGES], Field(discriminator="cmd")])  # type: ignore[valid-type, arg-type]


def command_from_wire(cmd: Any, args: Any) -> Command:
    """The command named `cmd` with wire arguments `args`, validated (an explicit null refused)."""
    try:
        return _MESSAGE.validate_python({"cmd": cmd, "args": args}, context=WIRE).args
    except ValidationError as e:
        raise ProtocolError(_wire_words(e, cmd)) from None


def _wire_words(e: ValidationError, cmd: Any) -> str:
    first = e.errors()[0]
    if first["type"].startswith("union_tag"):  # no `cmd`, or one that names no request
        return f"unknown command {cmd!r}; allowed: {', '.join(sorted(COMMANDS))}, subscribe"
    if first["type"] == "model_type" and first["loc"] == (cmd, "args"):
        return f"{cmd}: field `args` must be an object (the arguments by name)"
    return in_words([{**err, "loc": err["loc"][2:]} for err in e.errors()], REQUESTS[cmd])


def parse_command(msg: Any) -> tuple[str, Command]:
    """Validate a decoded client message (the token is checked elsewhere); returns
    (request id, command)."""
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    req_id = msg.get("id")
    if not isinstance(req_id, (str, int)) or isinstance(req_id, bool):
        raise ProtocolError("field `id` must be a string or integer")
    return str(req_id), command_from_wire(msg.get("cmd"), msg.get("args", {}))
