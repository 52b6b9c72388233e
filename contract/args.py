"""A run config from a command line: `[CONFIG.yaml] [key=value ...]`, as `./launch.sh train`
takes it. No config file: the embedded default preset, with the overrides on top."""

from __future__ import annotations

from contract import presets
from contract.config import RunConfig, load_config


def config_from_args(args: list[str]) -> RunConfig:
    """The first argument without `=` is the config file; every other one is an override
    (dotted field name or short name, `key=value`). Raises ConfigError naming every problem."""
    config_path: str | None = None
    overrides: list[str] = []
    for arg in args:
        if "=" not in arg and config_path is None:
            config_path = arg
        else:
            overrides.append(arg)
    return load_config(config_path, overrides, data=None if config_path else presets.DEFAULT)
