"""What every command of the protocol is made of: the error a bad message gets, the pydantic
model whose fields are a command's arguments (type, default, bounds and description declared
once with `Field`; pydantic validates them, strictly), the argument types several commands share,
and the translation of pydantic's errors into this project's messages: each names the command,
the argument and what is allowed. The commands are in contract.protocol.commands,
branch_commands, data_commands and completion_commands."""

from __future__ import annotations

import math
import typing
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from contract.protocol.answers import Answer
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
_EXPECTED = {"bool_type": "true or false", "int_type": "an integer", "float_type": "a number",
             "string_type": "a string", "list_type": "a list", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object"}
_BOUNDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def in_words(errors: list[ErrorDetails], model: type[Arguments]) -> str:
    """Every problem pydantic found in `model`'s arguments, one a line, each naming the command,
    the argument and what is allowed."""
    return "\n".join(dict.fromkeys(_problem(err, model, _label_of(model)) for err in errors))


def _problem(err: ErrorDetails, model: type[BaseModel], label: str) -> str:
    loc, kind, given = list(err["loc"]), err["type"], err.get("input")
    while loc and isinstance(loc[0], str) and (inner := _nested(model, loc[0])) is not None and \
            (len(loc) > 1 or kind == "value_error"):  # an argument of a nested object (set generation)
        label, model, loc = f"{label} {loc[0]}", inner, loc[1:]
    name = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    field = model.model_fields.get(loc[0]) if loc and isinstance(loc[0], str) else None
    if kind == "value_error":  # a rule of ours (a validator's ValueError): its own words
        return f"{label}: {err.get('ctx', {}).get('error', err['msg'])}"
    if kind == "extra_forbidden":
        return f"{label}: unknown argument {name!r}; allowed: {', '.join(model.model_fields) or 'none'}"
    if kind == "missing":
        return f"{label}: argument {name!r} is required: {field.description if field else ''}"
    if kind == "null_given":
        return f"{label}: argument {name!r} has the wrong type (NoneType); {err['msg']}"
    big = kind == "float_type" and isinstance(given, int) and not isinstance(given, bool)
    if field is not None and (kind in _BOUNDS or big):  # a 400-digit integer: no float holds it
        return f"{label}: argument {name!r} must be {_bounds(field.metadata)}, got {_shown(given)}"
    if kind == "literal_error":
        return f"{label}: argument {name!r} must be one of {err.get('ctx', {}).get('expected')}, got {given!r}"
    expected = _EXPECTED.get(kind, err["msg"].lower())
    return f"{label}: argument {name!r} has the wrong type ({type(given).__name__}); expected {expected}"


def _nested(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The model an argument holds (`Set.generation`), if it holds one."""
    field = model.model_fields.get(name)
    annotation = field.annotation if field is not None else None
    for kind in typing.get_args(annotation) or (annotation,):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


def _bounds(metadata: list[Any]) -> str:
    """A field's bounds in words (`> 0.0 and <= 1.0`), from its `gt` / `ge` / `le` (annotated_types)."""
    signs = {"gt": ">", "ge": ">=", "le": "<="}
    return " and ".join(f"{sign} {getattr(m, key)}" for key, sign in signs.items() for m in metadata if hasattr(m, key))


def _shown(value: Any) -> str:
    if isinstance(value, int) and abs(value) >= 10**18:
        return f"a {int(math.log10(abs(value))) + 1}-digit number"
    return str(value)


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
