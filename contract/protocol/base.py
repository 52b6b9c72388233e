"""What every command of the protocol is made of: the error a bad message gets, the declaration of
an argument (default, documentation, bounds in one place), the validation that those
declarations drive, and the Command base class. The commands themselves are in contract.protocol,
contract.protocol.branch_commands and contract.protocol.data_commands; import them through contract.protocol."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, Union

from contract.protocol.roles import Role

_ROLES = ("system", "user", "assistant")


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
    # who may send it (contract.protocol.roles): a command changes the run unless it says viewer
    role: ClassVar[Role] = Role.OPERATOR

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
