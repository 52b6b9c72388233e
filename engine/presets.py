"""Named starting configs (the UI's presets, and `./launch.sh train` with no config file)."""

from __future__ import annotations

from engine.default_task import RECOMMENDED as _R

# The embedded default: a tiny Llama learning the synthetic task with the hyperparameters
# measured for it (engine/default_task.py); exact-match is measured during the run so the user
# sees it climb.
DEFAULT: dict = {
    "optim": {"lr": _R["lr"], "warmup_steps": _R["warmup_steps"]},
    "train": {"micro_batch_size": _R["micro_batch_size"], "max_steps": _R["max_steps"]},
    "data": {"max_length": _R["max_length"], "batching": _R["batching"]},
    "eval": {"every_n_steps": _R["eval_every_n_steps"], "evaluators": ["perplexity", "exact_match"],
             "max_samples": 128, "batch_size": 64},
}

PRESETS: dict[str, dict] = {
    "embedded default": DEFAULT,
    "ZeRO-3, 2 processes": {**DEFAULT, "parallel": {"nproc": 2, "zero_stage": 3}},
    "LoRA on a local model folder": {"method": {"name": "lora"}, "optim": {"lr": 2e-4}},
    "LOMO full fine-tune": {"method": {"name": "lomo"}, "optim": {"lr": 1e-3}},
}
