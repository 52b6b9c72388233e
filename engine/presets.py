"""Named starting configs (the UI's presets, and `./launch.sh train` with no config file)."""

from __future__ import annotations

# The embedded default: a tiny Llama learning the synthetic task; exact-match is measured during
# the run so the user sees it climb.
DEFAULT: dict = {
    "eval": {"every_n_steps": 50, "evaluators": ["perplexity", "exact_match"], "max_samples": 128,
             "batch_size": 64},
}

PRESETS: dict[str, dict] = {
    "embedded default": DEFAULT,
    "ZeRO-3, 2 processes": {**DEFAULT, "parallel": {"nproc": 2, "zero_stage": 3}},
    "LoRA on a local model folder": {"method": {"name": "lora"}, "optim": {"lr": 2e-4}},
    "LOMO full fine-tune": {"method": {"name": "lomo"}, "optim": {"lr": 1e-3}},
}
