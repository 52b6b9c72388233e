"""Pydantic's validation errors in this project's words: the one translator that the run config
(contract.config.checks: `optim.lr: must be at least 0.0, got -1`) and the commands
(contract.protocol.base: `set: argument 'lr' must be at least 0.0 and at most 10.0, got -1`)
both use. Each error becomes a `Problem`: where it is (the nested models it sits in, then the
field) and what is wrong, in one vocabulary; the caller only says how a place is named (a config
key, a command's argument). Torch-free; imports nothing of ours."""

from __future__ import annotations

import math
import typing
from enum import Enum
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

# what each type error expected, in words (strict and lax pydantic name them differently)
_EXPECTED = {"bool_type": "true or false", "bool_parsing": "true or false", "int_type": "an integer",
             "int_parsing": "an integer", "int_from_float": "an integer", "float_type": "a number",
             "float_parsing": "a number", "string_type": "a string", "list_type": "a list",
             "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping"}
_BOUNDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


class Problem(NamedTuple):
    """One validation error: `within` the nested models it sits in (`("optim",)`, `("generation",)`),
    `name` the field there (`lr`, `messages[0].content`; empty for a rule of the model itself),
    `kind`: "unknown" (a name the model does not declare: `words` lists what it does), "rule" (a
    validator of ours: `words` are its own) or "value" (`words` say what is allowed and what was
    given)."""
    within: tuple[str, ...]
    name: str
    kind: str
    words: str


def problems(errors: list[ErrorDetails], model: type[BaseModel]) -> list[Problem]:
    """Every error pydantic found validating `model`, in words, each once."""
    return list(dict.fromkeys(problem(err, model) for err in errors))


def problem(err: ErrorDetails, model: type[BaseModel]) -> Problem:
    """One pydantic error (of validating `model`) in words."""
    loc, kind = list(err["loc"]), err["type"]
    within: list[str] = []
    while loc and isinstance(loc[0], str) and (inner := nested(model, loc[0])) is not None and \
            (len(loc) > 1 or kind == "value_error"):  # a field of a nested model, or its own rule
        within.append(loc[0])
        model, loc = inner, loc[1:]
    name = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if kind == "value_error":  # a rule of ours (a validator's ValueError): its own words
        return Problem(tuple(within), name, "rule", str(err.get("ctx", {}).get("error", err["msg"])))
    if kind == "extra_forbidden":
        return Problem(tuple(within), name, "unknown", _known(model, str(loc[-1])))
    field = model.model_fields.get(loc[0]) if loc and isinstance(loc[0], str) else None
    return Problem(tuple(within), name, "value", _value_words(err, field, whole=len(loc) == 1))


def _value_words(err: ErrorDetails, field: FieldInfo | None, whole: bool) -> str:
    """What is wrong with a value given for `field` (`whole`: the field's own value, not an item
    of it): what it must be, and what was given."""
    kind, given, ctx = err["type"], err.get("input"), err.get("ctx", {})
    if kind == "missing":
        return f"is required ({field.description.rstrip('.') if field and field.description else 'no default'})"
    if kind == "null_given":  # a custom error of ours: its message says what to do instead
        return f"must not be null: {err['msg']}"
    if kind == "finite_number":
        return f"must be a number, got {given} (nan and inf are not numbers)"
    big = kind == "float_type" and isinstance(given, int) and not isinstance(given, bool)
    if field is not None and (kind in _BOUNDS or big):  # a 400-digit integer: no float holds it
        return f"must be {bounds(field.metadata)}, got {_shown(given)}"
    if kind in ("literal_error", "enum"):
        allowed = choices(field.annotation) if field is not None and whole else None
        return f"must be one of {', '.join(map(repr, allowed)) if allowed else ctx.get('expected')}, got {given!r}"
    if kind == "bool_for_number" or (isinstance(given, bool) and kind in ("int_type", "float_type")):
        expected = "an integer" if kind == "int_type" or (field and field.annotation is int) else "a number"
        return f"must be {expected}, got {given!r} (true / false is not a number)"
    return f"must be {_EXPECTED.get(kind, err['msg'].lower())}, got {given!r}"


def nested(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The model a field holds (a config section, `Set.generation`), if it holds one."""
    field = model.model_fields.get(name)
    annotation = field.annotation if field is not None else None
    for kind in typing.get_args(annotation) or (annotation,):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


def choices(annotation: Any) -> list | None:
    """The values a field allows, where it allows a few: a Literal's or an Enum's (also inside
    `... | None`); None for any other type."""
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return [m.value for m in annotation]
    for part in typing.get_args(annotation) if typing.get_origin(annotation) is not None else ():
        found = choices(part)
        if found is not None:
            return found
    return None


def bounds(metadata: list[Any]) -> str:
    """A field's bounds in words (`above 0.0 and at most 1.0`), from its gt / ge / lt / le."""
    words = {"gt": "above", "ge": "at least", "lt": "below", "le": "at most"}
    return " and ".join(f"{word} {getattr(m, key)}" for key, word in words.items() for m in metadata
                        if hasattr(m, key))


def _known(model: type[BaseModel], name: str) -> str:
    """What a model declares, for an unknown name: the close ones, else all of them."""
    known = list(model.model_fields)
    close = [k for k in known if k.startswith(name[:3])] if name else []
    return f"did you mean {', '.join(close)}?" if close else f"allowed: {', '.join(known) or 'none'}"


def _shown(value: Any) -> str:
    if isinstance(value, int) and abs(value) >= 10**18:
        return f"a {int(math.log10(abs(value))) + 1}-digit number"
    return str(value)
