"""Named starting configs (the UI's presets, and `./launch.sh train` with no config file)."""

from __future__ import annotations

# The embedded default task's hyperparameters, measured by bench/bench_default.py (engine/data/default_task.py
# reads them from here): the contract holds them so that presets need no engine import.
RECOMMENDED: dict[str, float | int | str] = {
    "lr": 3e-3,
    "micro_batch_size": 64,
    "max_steps": 1000,
    "warmup_steps": 50,
    "max_length": 32,
    "eval_every_n_steps": 100,
    # Not group_by_length: a batch's length nearly fixes its instruction and word length here,
    # and such one-kind batches learn 4x slower (25% exact match after 1000 steps, not 97%).
    "batching": "random",
}
_R = RECOMMENDED

# The embedded default model's size (a tiny Llama; engine/data/default_task.py builds it from this):
# kept here so that layout checks need no engine import.
# "positions" is its max_position_embeddings (engine/data/default_task.py default_model_config).
MODEL_SIZE: dict[str, int] = {"hidden": 128, "layers": 2, "heads": 4, "intermediate": 384, "positions": 256}

# The embedded default: a tiny Llama learning the synthetic task with the hyperparameters
# measured for it (engine/data/default_task.py); exact-match is measured during the run so the user
# sees it climb. It is for the embedded default only: a command line that names a model
# (model.path) or data (data.train) starts from the schema's defaults instead, with
# data.max_length fitted to the model (contract.args).
DEFAULT: dict = {
    "optim": {"lr": _R["lr"], "warmup_steps": _R["warmup_steps"]},
    "train": {"micro_batch_size": _R["micro_batch_size"], "max_steps": _R["max_steps"]},
    "data": {"max_length": _R["max_length"], "batching": _R["batching"]},
    "eval": {"every_n_steps": _R["eval_every_n_steps"], "evaluators": ["perplexity", "exact_match"],
             "max_samples": 128, "batch_size": 64},
}

# The embedded default's GRPO variant (`./launch.sh train objective=grpo`, docs/rewards.md). GRPO
# learns only from right answers it samples, and a random model almost never writes one: the run
# starts from the default task's SFT model (WARM_START_STEPS steps of DEFAULT, trained first and
# kept in the output folder for the next GRPO run: supervisor.warm_start), answering about 80% of
# the held-out prompts right, and samples short answers (the task's are words) in groups of 8.
# Measured by bench/bench_grpo_default.py: after 300 SFT steps (40% right) the sampled answers
# were right 10% of the time and GRPO's reward rose slowly at lr 5e-4 and collapsed to 0 at 1e-3.
WARM_START_STEPS = 500
GRPO_DEFAULT: dict = {
    "optim": {"lr": 3e-4, "warmup_steps": 0},
    "train": {"micro_batch_size": 8, "max_steps": 300},
    "data": {"max_length": _R["max_length"], "batching": _R["batching"]},
    "grpo": {"num_generations": 8, "max_completion_length": 16},
}

PRESETS: dict[str, dict] = {
    "embedded default": DEFAULT,
    "ZeRO-3, 2 processes": {**DEFAULT, "parallel": {"nproc": 2, "zero_stage": 3}},
    "LoRA on a local model folder": {"method": {"name": "lora"}, "optim": {"lr": 2e-4}},
    "LOMO full fine-tune": {"method": {"name": "lomo"}, "optim": {"lr": 1e-3}},
}
