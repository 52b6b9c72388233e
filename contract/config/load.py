"""Loading a run config: a YAML file and/or a dict, then `key=value` overrides, validated by the
schema's pydantic models (contract.config.checks.build). Unknown keys, wrong types, bounds and
impossible combinations are all collected and raised in one ConfigError that names every field
at fault."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from contract.config.checks import absolute_paths, build, validate
from contract.config.schema import SHORTCUTS, ConfigError, RunConfig


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
    config, found = build(raw)
    problems += found
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
