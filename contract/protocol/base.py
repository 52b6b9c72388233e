"""What every command of the protocol is made of: the error a bad message gets, the pydantic
model whose fields are a command's arguments (type, default, bounds and description declared
once with `Field`; pydantic validates them, strictly), the argument types several commands share,
and the translation of pydantic's errors into this project's messages: each names the command,
the argument and what is allowed. The commands are in contract.protocol.commands,
branch_commands, data_commands and completion_commands."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from contract.protocol.answers import Answer
from contract.validation_words import Problem, problems
from contract.protocol.roles import Role

_ROLES = ("system", "user", "assistant")
# the validation context of a decoded message: there an explicit null is refused (in Python, an
# argument given as None is one not given: the run's setting applies)
WIRE = {"wire": True}


class ProtocolError(ValueError):
    """A message or command that breaks the protocol; the text names the field at fault."""


# -- argument types several commands share -------------------------------------------------------
def _non_empty_strings(stop: list[str]) -> list[str]:
    if not all(stop):
        raise ValueError("argument 'stop' must be a list of non-empty strings")
    return stop


def _chat(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    if not messages:
        raise ValueError("`messages` must not be empty")
    for i, m in enumerate(messages):
        if set(m) != {"role", "content"} or m["role"] not in _ROLES:
            raise ValueError(f"messages[{i}] must be {{\"role\": one of {', '.join(_ROLES)}, \"content\": a string}}")
    return messages


StopStrings = Annotated[list[str], AfterValidator(_non_empty_strings)]
# a chat: a non-empty list of {"role": system|user|assistant, "content": str}
Chat = Annotated[list[dict[str, str]], AfterValidator(_chat)]


# -- the model every command's arguments are --------------------------------------------------------
class Arguments(BaseModel):
    """Validated arguments: unknown names, wrong types (strictly: no "1" for 1, no 1 for true),
    bounds and non-finite numbers are refused on construction, with a ProtocolError."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)
    label: ClassVar[str] = ""  # how errors name them (a command: by its name)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise ProtocolError(in_words(e.errors(), type(self))) from None

    # pydantic's own mark (as on BaseModel.__init__ and RootModel.__init__): this __init__ only
    # renames the error, so a command nested in a message is validated without calling it (and
    # keeps the message's validation context)
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @field_validator("*", mode="before")
    @classmethod
    def _no_null_on_the_wire(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and isinstance(info.context, dict) and info.context.get("wire"):
            raise PydanticCustomError("null_given", "leave it out for the run's setting")
        return value

    def args(self) -> dict[str, Any]:
        """The arguments that were given (not None), nested ones as plain dicts: the wire form."""
        return self.model_dump(exclude_none=True)


def _label_of(model: type[Arguments]) -> str:
    """How errors name a command (its wire name) or other arguments (their label)."""
    return getattr(model, "name", "") or model.label


# -- pydantic's errors in this project's words ---------------------------------------------------
def in_words(errors: list[ErrorDetails], model: type[Arguments]) -> str:
    """Every problem pydantic found in `model`'s arguments, one a line, each naming the command
    (and the nested object: `set generation`), the argument and what is allowed, in the words of
    the one translator (contract.validation_words) the config uses too."""
    return "\n".join(dict.fromkeys(_said(found, _label_of(model)) for found in problems(errors, model)))


def _said(found: Problem, label: str) -> str:
    label = " ".join([label, *found.within])
    if found.kind == "unknown":
        return f"{label}: unknown argument {found.name!r}; {found.words}"
    if found.kind == "rule" or not found.name:  # a rule of ours: its own words
        return f"{label}: {found.words}"
    return f"{label}: argument {found.name!r} {found.words}"


# -- the commands ------------------------------------------------------------------------------
class Command(Arguments):
    """A request to the run. `name` is its wire name; `to_wire()` its {"cmd", "args"} form."""

    name: ClassVar[str] = ""
    # answered by rank 0 at once, without waiting for a step boundary
    immediate: ClassVar[bool] = False
    # who may send it (contract.protocol.roles): a command changes the run unless it says viewer
    role: ClassVar[Role] = Role.OPERATOR
    # what it answers (contract.protocol.answers): rank 0 builds it, the client parses it
    returns: ClassVar[type[Answer]] = Answer

    def to_wire(self) -> dict[str, Any]:
        return {"cmd": self.name, "args": self.args()}

    @property
    def answered_at_once(self) -> bool:
        """Rank 0 answers it from its server thread, without a step boundary."""
        return self.immediate
