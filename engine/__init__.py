"""The training engine: `from engine import Trainer, RunConfig`.

Attributes are imported on first use, so that the run config (`contract.config.schema`) and the other torch-free modules
can be used by the app process without importing torch.
"""

from __future__ import annotations

_EXPORTS = {
    "Trainer": "engine.trainer",
    "TrainerState": "engine.context",
    "Callback": "engine.callbacks",
    "RunConfig": "contract.config.schema",
    "load_config": "contract.config.load",
    "ConfigError": "contract.config.schema",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
