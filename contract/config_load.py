"""Loading a run config: a YAML file and/or a dict, then `key=value` overrides, built strictly
into the typed schema. Unknown keys, wrong types and impossible combinations are all collected
and raised in one ConfigError that names every field at fault."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from contract.config_checks import absolute_paths, validate
from contract.config_schema import SHORTCUTS, ConfigError, RunConfig


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                data: dict | None = None) -> RunConfig:
    """Build a validated RunConfig from a YAML file and/or a dict, then `key=value` overrides."""
    raw: dict = {}
    problems: list[tuple[str, str]] = []
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError([("config", f"file not found: {path}")]) from None
        except yaml.YAMLError as e:
            raise ConfigError([("config", f"{path} is not valid YAML: {e}")]) from None
        if not isinstance(loaded, dict):
            raise ConfigError([("config", f"{path} must hold a mapping of sections, not {type(loaded).__name__}")])
        raw = loaded
    if data:
        merge(raw, data)
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append((item, "an override must look like key=value"))
            continue
        key = SHORTCUTS.get(key.strip(), key.strip())
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            parsed = value
        _set_dotted(raw, key, parsed)
    config = _build(RunConfig, raw, "", problems)
    absolute_paths(config)
    problems += validate(config)
    if problems:
        raise ConfigError(problems)
    return config


def config_from_dict(data: dict) -> RunConfig:
    """A validated RunConfig from a (possibly partial) nested dict."""
    return load_config(data=data)


def merge(dst: dict, src: dict) -> None:
    """Lay the nested config dict `src` over `dst`, section by section (in place)."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        else:
            dst[k] = v


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str, problems: list[tuple[str, str]]) -> Any:
    """Instantiate dataclass `cls` from `raw`, appending every problem found."""
    if not isinstance(raw, dict):
        problems.append((prefix.rstrip(".") or "config", f"expected a mapping, got {raw!r}"))
        raw = {}
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            close = [k for k in known if k.startswith(str(key)[:3])]
            hint = f"; did you mean {', '.join(close)}?" if close else f"; allowed: {', '.join(known)}"
            problems.append((f"{prefix}{key}", f"unknown key{hint}"))
    values = {}
    for name, f in known.items():
        if name not in raw:
            continue
        tp, key = hints[name], f"{prefix}{name}"
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            values[name] = _build(tp, raw[name], key + ".", problems)
        else:
            ok, value = _coerce(raw[name], tp)
            if ok:
                values[name] = value
            else:
                problems.append((key, f"expected {_type_name(tp)}, got {raw[name]!r}"))
    return cls(**values)


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp), value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v = _coerce(value, arg)
            if ok:
                return True, v
        return False, value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):  # `key=a,b` from the command line or a form
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            return False, value
        out = []
        for v in value:
            ok, c = _coerce(v, item_tp)
            if not ok:
                return False, value
            out.append(c)
        return True, out
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, str):  # YAML reads 1e-3 (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return isinstance(value, (int, float)) and not isinstance(value, bool), float(value) if isinstance(value, (int, float)) else value
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, str(value)
        return isinstance(value, str), value
    if tp is dict:
        return isinstance(value, dict), value
    return isinstance(value, tp), value


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a mapping"}.get(tp, str(tp))
