"""The run config: one typed schema for everything a run needs. Everything outside the contract
imports it from here; the parts live in four small modules:

- contract.config_schema: the sections and their fields (documented where declared), the
  shortcuts (`lr=`, `nproc=`), ConfigError;
- contract.config_load: load_config from a YAML file, a dict and `key=value` overrides;
- contract.config_checks: absolute paths, field bounds and the combinations that cannot work;
- contract.config_form: the entries the front ends build their forms from.

Torch-free, so the app process can use it. Loading is strict: every problem is collected and
reported in one ConfigError that names every field at fault.
"""

from __future__ import annotations

from contract.config_checks import (SOURCE_FORMATS, SOURCE_KEYS, absolute_paths, guard_problems, source_name,
                                    source_problems, validate)
from contract.config_form import field_label, get_value, schema
from contract.config_load import config_from_dict, load_config, merge
from contract.config_schema import (EVALUATORS, FUSED_METHODS, METHODS, PEFT_METHODS, SHORTCUTS, CheckpointConfig,
                                    ConfigError, ControlConfig, DataConfig, EvalConfig, GuardConfig, LoggingConfig,
                                    MethodConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig, TeachConfig,
                                    TrainConfig)

__all__ = [
    "EVALUATORS", "FUSED_METHODS", "METHODS", "PEFT_METHODS", "SHORTCUTS", "SOURCE_FORMATS", "SOURCE_KEYS",
    "CheckpointConfig", "ConfigError", "ControlConfig", "DataConfig", "EvalConfig", "GuardConfig",
    "LoggingConfig", "MethodConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RunConfig", "TeachConfig",
    "TrainConfig", "absolute_paths", "config_from_dict", "field_label", "get_value", "guard_problems",
    "load_config", "merge", "schema", "source_name", "source_problems", "validate",
]
