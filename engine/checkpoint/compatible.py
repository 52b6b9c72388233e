"""Whether a training checkpoint fits this run: the same layout, model and data order.

An exact resume (or a rewind) needs the checkpoint's parallel layout, model and method, and the
sampler's data order; every mismatch is an error naming both sides and, for another layout, how
to carry the state over (DeepSpeed's universal checkpoint). `config_changes` lists the settings
that differ from the checkpoint's (the resume event names them).
"""

from __future__ import annotations

from engine.checkpoint.locations import CheckpointError, LayoutMismatchError
from engine.context import RunContext
from engine.model.loading import count_parameters

LAYOUT_KEYS = ("world_size", "dp_size", "tp_size", "pp_size", "zero_stage")
MODEL_KEYS = ("precision", "method", "parameters", "trainable_parameters")
# settings that cannot change the trajectory: left out of `config_changes`
_NOT_TRAINING = ("resume", "logging.", "control.", "checkpoint.", "eval.")


class DataMismatchError(CheckpointError):
    """The run's data order differs from the checkpoint's (seed, sizes, batching ...)."""


def layout_record(run: RunContext) -> dict:
    p = run.config.parallel
    return {"world_size": run.env.world_size, "dp_size": run.env.dp_size, "tp_size": p.tp_size,
            "pp_size": p.pp_size, "zero_stage": int(run.engine.zero_optimization_stage())}


def model_of(run: RunContext) -> dict:
    total, trainable = count_parameters(run.engine.module)
    return {"precision": run.precision, "method": run.config.method.name,
            "parameters": total, "trainable_parameters": trainable}


def describe_layout(layout: dict) -> str:
    return (f"dp {layout.get('dp_size')} x tp {layout.get('tp_size')} x pp {layout.get('pp_size')}, "
            f"ZeRO {layout.get('zero_stage')} ({layout.get('world_size')} rank"
            f"{'s' * (layout.get('world_size') != 1)})")


def check_compatible(run: RunContext, record: dict, url: str, sampler=None) -> None:
    """Same parallel layout, same model, same data order (when `sampler`, the run's batch
    sampler, is given) -- or an error naming both sides."""
    saved, now = record.get("layout", {}), layout_record(run)
    if any(saved.get(k) != now[k] for k in LAYOUT_KEYS):
        raise LayoutMismatchError(
            f"{url} was written by {describe_layout(saved)}; this run is {describe_layout(now)}. An exact "
            f"resume needs the checkpoint's layout: set parallel.nproc={saved.get('world_size')} "
            f"zero_stage={saved.get('zero_stage')} tp={saved.get('tp_size')} pp={saved.get('pp_size')}. "
            + _universal_hint(url, record))
    saved_model, model = record.get("model", {}), model_of(run)
    differ = [f"{k}: checkpoint {saved_model.get(k)!r}, this run {model[k]!r}" for k in MODEL_KEYS
              if saved_model.get(k) != model[k]]
    if differ:
        raise LayoutMismatchError(f"{url} holds another model or method ({'; '.join(differ)}); nothing was loaded")
    saved_sampler = record.get("sampler")
    if saved_sampler is not None and hasattr(sampler, "load_state_dict"):
        try:
            sampler.load_state_dict(saved_sampler)
        except Exception as e:  # noqa: BLE001 - the data layer's own message says what differs
            raise DataMismatchError(f"{url}: {e}; nothing was loaded") from None


def _universal_hint(url: str, record: dict) -> str:
    """How to carry the state to another layout (DeepSpeed's universal checkpoint), when possible."""
    tag = record.get("ds_tag", "global_stepN")
    if int(record.get("layout", {}).get("zero_stage", 0)) == 0:
        return ("DeepSpeed's universal checkpoint conversion needs a ZeRO 1-3 checkpoint; to start a "
                "new run in another layout from these weights, export them (load_checkpoint in the old "
                "layout, then save_model) and set model.path to the export")
    return ("To carry the model and optimizer state to the new layout instead (a new run, not an exact "
            "resume: the data order and RNG streams differ), convert it with DeepSpeed's universal "
            f"checkpoint tool: python -m deepspeed.checkpoint.ds_to_universal --input_folder {url}/{tag} "
            f"--output_folder {url}/{tag}_universal, and load that with DeepSpeed's load_checkpoint under "
            'the DeepSpeed config {"checkpoint": {"load_universal": true}}')


def config_changes(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose value differs (left out: fields that cannot change the trajectory)."""
    changes = []
    for key in sorted(set(saved) | set(now)):
        dotted = f"{prefix}{key}"
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, dotted + ".")
        elif a != b and not dotted.startswith(_NOT_TRAINING):
            changes.append(dotted)
    return changes
