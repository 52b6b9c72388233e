"""The DeepSpeed config of a run, built from the run config: torch-free, so that the pre-flight
check (contract.preflight) finds every contradiction before any rank starts, and the engine
(engine.parallel.ds_config, which adds precision detection and the running engine's internals) builds
the very same config from the same code.

It follows the Hugging Face `"auto"` convention (transformers' HfTrainerDeepSpeedConfig), with
one difference: a key that is *absent* is treated like `"auto"` wherever the run config knows
its value, so a run without any DeepSpeed config gets a complete one. Explicit values that
contradict the run config are all collected and reported in one :class:`DeepSpeedConfigError`.

Optimizer and scheduler ownership (as transformers' `deepspeed_optim_sched` has it):

- an `optimizer` section: DeepSpeed builds the optimizer, and then a `scheduler` section is
  required too (our trainer builds a torch scheduler only around its own torch optimizer, so a
  DeepSpeed optimizer alone would silently train at a constant learning rate);
- no `optimizer` section: the trainer passes a torch optimizer; `scheduler` may still be given
  (DeepSpeed then wraps the torch optimizer); under ZeRO-Offload this needs
  `zero_force_ds_cpu_optimizer: false`, which is set with a warning.

`"type": "auto"` picks DeepSpeed's counterpart of the run's choice: optim.name adamw -> AdamW,
sgd -> SGD; optim.scheduler constant -> WarmupLR, linear -> WarmupDecayLR, cosine ->
WarmupCosineLR (decaying to 0, like the torch cosine schedule). Their warmup is linear, as the
run config's is (DeepSpeed's default would be logarithmic). DeepSpeed's schedules are not step
for step the torch ones the trainer builds: they spend the first two steps at warmup_min_lr and
warm up over at least 2 steps; leave "scheduler" out for the trainer's exact schedule.

The resolved precision is an argument: resolving "auto" needs the hardware (engine.parallel.ds_config).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.config.schema import ConfigError, RunConfig

AUTO = "auto"
PRECISIONS = ("bf16", "fp16", "fp32")
NO_LOG_STEPS = 2**31 - 1  # DeepSpeed prints every `steps_per_print` steps; we log ourselves

OPTIMIZER_TYPES = {"adamw": "AdamW", "sgd": "SGD"}
SCHEDULER_TYPES = {"constant": "WarmupLR", "linear": "WarmupDecayLR", "cosine": "WarmupCosineLR"}
# The parameters each known optimizer takes, so that absent ones are only added where they fit.
_ADAM = ("lr", "betas", "eps", "weight_decay")
OPTIMIZER_PARAMS = {"adam": _ADAM, "adamw": _ADAM, "lamb": _ADAM, "onebitadam": _ADAM,
                    "zerooneadam": _ADAM, "onebitlamb": _ADAM, "lion": ("lr", "betas", "weight_decay"),
                    "adagrad": ("lr", "eps", "weight_decay"), "sgd": ("lr", "weight_decay")}
_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")
SCHEDULER_PARAMS = {"warmuplr": _WARMUP, "warmupdecaylr": (*_WARMUP, "total_num_steps"),
                    "warmupcosinelr": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                                       "cos_min_ratio", "warmup_type")}
OFFLOAD_DEVICES = ("cpu", "nvme")


class DeepSpeedConfigError(ConfigError):
    """The DeepSpeed config and the run config disagree; `problems` is a list of (field, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__(problems)
        lines = "\n".join(f"  - {key}: {msg}" for key, msg in problems)
        n = len(problems)
        self.args = (f"the DeepSpeed config does not fit the run config ({n} problem{'s' * (n != 1)}):\n{lines}",)


# -- a dict with dotted-key queries (accelerate style) -----------------------------------------

class DsConfig:
    """A DeepSpeed config dict queried and filled by dotted keys ("zero_optimization.stage").

    :meth:`fill` records every contradiction in `problems` instead of raising, so that all of
    them are reported at once.
    """

    def __init__(self, config: dict):
        self.config = config
        self.problems: list[tuple[str, str]] = []

    def _node(self, key: str, create: bool = False) -> tuple[dict | None, str]:
        *parents, leaf = key.split(".")
        node: Any = self.config
        for part in parents:
            if not isinstance(node.get(part), dict):
                if not create:
                    return None, leaf
                node[part] = {}
            node = node[part]
        return node, leaf

    def has(self, key: str) -> bool:
        node, leaf = self._node(key)
        return node is not None and leaf in node

    def get(self, key: str, default: Any = None) -> Any:
        node, leaf = self._node(key)
        return default if node is None else node.get(leaf, default)

    def set(self, key: str, value: Any) -> None:
        node, leaf = self._node(key, create=True)
        assert node is not None  # create=True makes every parent
        node[leaf] = value

    def delete(self, key: str) -> None:
        node, leaf = self._node(key)
        if node is not None:
            node.pop(leaf, None)

    def is_auto(self, key: str) -> bool:
        return self.get(key) == AUTO

    def is_true(self, key: str) -> bool:
        return self.get(key) not in (None, False, AUTO) and bool(self.get(key))

    def fill(self, key: str, value: Any, source_name: str | None = None, *, shown: Any = None,
             set_absent: bool = True) -> None:
        """Put the run's `value` at `key` when it is "auto" (or absent and `set_absent`).

        An explicit value is kept; with a `source_name` (the run config field it must agree
        with) a different one is recorded as a problem; `shown` is the run-side value to print
        when it reads better than `value` (e.g. "bf16" rather than true).
        """
        if self.is_auto(key) or (set_absent and not self.has(key)):
            self.set(key, value)
            return
        current = self.get(key)
        if source_name is not None and current is not None and not _same(current, value):
            run_side = _show(value if shown is None else shown)
            self.problems.append((f"parallel.deepspeed.{key}",
                                  f'deepspeed.{key} is {_show(current)} but {source_name} is {run_side}; '
                                  f'set it to "auto" or make them equal'))

    def problem(self, key: str, message: str) -> None:
        self.problems.append((key, message))


def _same(a: Any, b: Any) -> bool:
    """Equal as config values: lists and tuples alike, numbers to float precision."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return all(isinstance(v, (bool, int)) for v in (a, b)) and bool(a) == bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# -- the config builder -------------------------------------------------------------------------

@dataclass
class DeepSpeedSetup:
    """A complete DeepSpeed config and what it means for the engine set-up."""
    config: dict
    warnings: list[str] = field(default_factory=list)
    ds_optimizer: bool = False  # DeepSpeed builds the optimizer from config["optimizer"]
    ds_scheduler: bool = False  # DeepSpeed builds the scheduler from config["scheduler"]

    @property
    def zero_stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))


def build_ds_config(cfg: RunConfig, *, world_size: int, dp_size: int, total_steps: int,
                    warmup_steps: int, hidden_size: int | None, precision: str) -> DeepSpeedSetup:
    """The DeepSpeed config of a run: the user's `parallel.deepspeed` (or nothing) with every
    "auto" and absent value filled from `cfg`; raises DeepSpeedConfigError naming every clash.

    `precision` is the resolved one (see :func:`resolve_precision`), `hidden_size` the model's
    (None when its config has none), `total_steps` / `warmup_steps` are optimizer steps.
    """
    ds = DsConfig(load_user_config(cfg.parallel.deepspeed))
    if precision not in PRECISIONS:
        ds.problem("train.precision", f"resolved precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if dp_size < 1 or world_size % dp_size:
        ds.problem("parallel.dp_size", f"data-parallel size {dp_size} must divide the world size {world_size}")
    warnings: list[str] = []
    _fill_batch(ds, cfg, dp_size)
    _fill_precision(ds, cfg, precision)
    _fill_zero(ds, cfg, hidden_size)
    _fill_optimizer(ds, cfg)
    _fill_scheduler(ds, cfg, total_steps, warmup_steps)
    _check_ownership(ds, warnings)
    if cfg.parallel.tp_size > 1 or ds.has("tensor_parallel.autotp_size"):
        ds.fill("tensor_parallel.autotp_size", cfg.parallel.tp_size, "parallel.tp_size")
        if cfg.parallel.tp_size > 1:  # full logits on every rank: see engine.parallel.tp
            ds.fill("tensor_parallel.vocab_parallel_lm_head", False,
                    "livetune's tensor parallelism (whole-vocabulary logits on every rank, for generation)")
    ds.fill("steps_per_print", NO_LOG_STEPS)
    ds.fill("wall_clock_breakdown", False)
    named = {key for key, _ in ds.problems}
    for key in _auto_keys(ds.config):
        if f"parallel.deepspeed.{key}" not in named:
            ds.problem(f"parallel.deepspeed.{key}", '"auto" but the run config has no value for it; give one')
    if ds.problems:
        raise DeepSpeedConfigError(ds.problems)
    return DeepSpeedSetup(ds.config, warnings, ds_optimizer="optimizer" in ds.config,
                          ds_scheduler="scheduler" in ds.config)


def load_user_config(spec: dict) -> dict:
    """A copy of the user's DeepSpeed config: the dict itself, or {"file": "path.json"} read."""
    if not isinstance(spec, dict):
        raise DeepSpeedConfigError([("parallel.deepspeed", f"expected a mapping or {{file: path.json}}, got {spec!r}")])
    if "file" not in spec:
        config = copy.deepcopy(spec)
    elif len(spec) > 1:
        raise DeepSpeedConfigError([("parallel.deepspeed", "give either {file: path.json} or the config "
                                     f"itself, not both (extra keys: {', '.join(k for k in spec if k != 'file')})")])
    else:
        config = _read_json(spec["file"])
    if "bfloat16" in config and "bf16" not in config:  # DeepSpeed's other name for the section
        config["bf16"] = config.pop("bfloat16")
    return config


def _read_json(path: str) -> dict:
    key = "parallel.deepspeed.file"
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DeepSpeedConfigError([(key, f"no such file: {path}")]) from None
    except json.JSONDecodeError as e:
        raise DeepSpeedConfigError([(key, f"{path} is not valid JSON: {e}")]) from None
    if not isinstance(config, dict):
        raise DeepSpeedConfigError([(key, f"{path} must hold a JSON object, not {type(config).__name__}")])
    return config


def _fill_batch(ds: DsConfig, cfg: RunConfig, dp_size: int) -> None:
    micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum
    ds.fill("train_micro_batch_size_per_gpu", micro, "train.micro_batch_size")
    ds.fill("gradient_accumulation_steps", accum, "train.grad_accum")
    ds.fill("train_batch_size", dp_size * micro * accum,
            f"data-parallel size {dp_size} x train.micro_batch_size {micro} x train.grad_accum {accum}")
    ds.fill("gradient_clipping", cfg.optim.grad_clip, "optim.grad_clip")


def _fill_precision(ds: DsConfig, cfg: RunConfig, precision: str) -> None:
    requested = cfg.train.precision
    shown = precision if requested == precision else f"{requested} ({precision} on this machine)"
    ds.fill("bf16.enabled", precision == "bf16", "train.precision", shown=shown)
    ds.fill("fp16.enabled", precision == "fp16", "train.precision", shown=shown)


def _fill_zero(ds: DsConfig, cfg: RunConfig, hidden_size: int | None) -> None:
    p = cfg.parallel
    ds.fill("zero_optimization.stage", p.zero_stage, "parallel.zero_stage")
    _fill_offload(ds, "offload_optimizer", p.offload_optimizer)
    _fill_offload(ds, "offload_param", p.offload_param)
    stage = ds.get("zero_optimization.stage")
    stage = stage if isinstance(stage, int) else p.zero_stage
    # Hidden-size based buckets (the transformers values). Absent keys are only filled where the
    # stage uses them and the hidden size is known; elsewhere DeepSpeed's defaults stay.
    buckets = (("reduce_bucket_size", lambda h: h * h, stage >= 1),
               ("stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h), stage == 3),
               ("stage3_param_persistence_threshold", lambda h: 10 * h, stage == 3))
    for name, size, used in buckets:
        key = f"zero_optimization.{name}"
        if ds.is_auto(key) and hidden_size is None:
            ds.problem(f"parallel.deepspeed.{key}", '"auto" is computed from the model\'s hidden size, '
                       "but the model config has no hidden_size; give a number instead")
        elif hidden_size is not None and (ds.is_auto(key) or used):
            ds.fill(key, size(hidden_size))
    if stage == 3:  # lets engine.save_16bit_model write a Hugging Face model from the shards
        ds.fill("zero_optimization.stage3_gather_16bit_weights_on_model_save", True)


def _fill_offload(ds: DsConfig, name: str, wanted: bool) -> None:
    key, source = f"zero_optimization.{name}", f"parallel.{name}"
    if ds.is_auto(key) or (not ds.has(key) and wanted):
        ds.set(key, {"device": "cpu" if wanted else "none"})
        return
    if not ds.has(key):
        return
    if not isinstance(ds.get(key), dict):
        ds.problem(f"parallel.deepspeed.{key}", f'expected a mapping like {{"device": "cpu"}}, got {ds.get(key)!r}')
        return
    device = ds.get(f"{key}.device", "none")
    if device == AUTO:
        ds.set(f"{key}.device", "cpu" if wanted else "none")
    elif (device in OFFLOAD_DEVICES) != wanted:
        ds.problem(f"parallel.deepspeed.{key}.device",
                   f"deepspeed.{key}.device is {json.dumps(device)} but {source} is {json.dumps(wanted)}; "
                   'set it to "auto" or make them agree')


def _fill_optimizer(ds: DsConfig, cfg: RunConfig) -> None:
    if "optimizer" not in ds.config:
        return
    if not isinstance(ds.get("optimizer"), dict):
        ds.problem("parallel.deepspeed.optimizer", f"expected a mapping with type and params, got {ds.get('optimizer')!r}")
        return
    o = cfg.optim
    ds.fill("optimizer.type", OPTIMIZER_TYPES[o.name])
    accepted = OPTIMIZER_PARAMS.get(str(ds.get("optimizer.type")).lower(), ())
    values = {"lr": (o.lr, "optim.lr"), "betas": (list(o.betas), "optim.betas"),
              "eps": (o.eps, "optim.eps"), "weight_decay": (o.weight_decay, "optim.weight_decay")}
    for name, (value, source) in values.items():
        ds.fill(f"optimizer.params.{name}", value, source, set_absent=name in accepted)


def _fill_scheduler(ds: DsConfig, cfg: RunConfig, total_steps: int, warmup_steps: int) -> None:
    if "scheduler" not in ds.config:
        return
    if not isinstance(ds.get("scheduler"), dict):
        ds.problem("parallel.deepspeed.scheduler", f"expected a mapping with type and params, got {ds.get('scheduler')!r}")
        return
    o = cfg.optim
    ds.fill("scheduler.type", SCHEDULER_TYPES[o.scheduler])
    accepted = SCHEDULER_PARAMS.get(str(ds.get("scheduler.type")).lower(), ())
    warmup_source = "optim.warmup_steps" if o.warmup_steps else f"optim.warmup_ratio {o.warmup_ratio} x total steps"
    # deepspeed >= 0.19.6 rejects warmup_num_steps < 1; a run without warmup asks for 1
    values = {"warmup_min_lr": (0.0, None), "warmup_max_lr": (o.lr, "optim.lr"),
              "warmup_num_steps": (max(1, warmup_steps), warmup_source),
              "total_num_steps": (max(1, total_steps), "the run's total optimizer steps"),
              "warmup_min_ratio": (0.0, None), "cos_min_ratio": (0.0, None), "warmup_type": ("linear", None)}
    for name, (value, source) in values.items():
        ds.fill(f"scheduler.params.{name}", value, source, set_absent=name in accepted)


def _check_ownership(ds: DsConfig, warnings: list[str]) -> None:
    """Who builds the optimizer and scheduler, and the switches that choice needs."""
    if "optimizer" in ds.config:
        if "scheduler" not in ds.config:
            ds.problem("parallel.deepspeed.optimizer", 'a DeepSpeed optimizer without a scheduler is an error: '
                       'add a "scheduler" section (e.g. {"type": "auto"}) or drop "optimizer" so the '
                       "trainer builds a torch optimizer and its schedule")
        return
    offloaded = ds.get("zero_optimization.offload_optimizer.device") in OFFLOAD_DEVICES
    if offloaded:
        if ds.is_true("zero_force_ds_cpu_optimizer"):
            ds.problem("parallel.deepspeed.zero_force_ds_cpu_optimizer",
                       "true demands DeepSpeed's CPU optimizer under offload, but there is no DeepSpeed "
                       '"optimizer" section; add one, or set it to false to step the torch optimizer on CPU')
        elif not ds.has("zero_force_ds_cpu_optimizer"):
            ds.set("zero_force_ds_cpu_optimizer", False)
            warnings.append("ZeRO-Offload with the trainer's torch optimizer: set zero_force_ds_cpu_optimizer "
                            "false, so the torch optimizer steps on CPU (slower than DeepSpeed's CPUAdam; add "
                            'a DeepSpeed "optimizer" and "scheduler" section to use that instead)')
    stage = ds.get("zero_optimization.stage", 0)
    if isinstance(stage, int) and stage > 0:  # any torch optimizer, not only DeepSpeed's tested list
        ds.fill("zero_allow_untested_optimizer", True)


def _auto_keys(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _auto_keys(v, f"{prefix}{k}.")
    elif node == AUTO:
        yield prefix.rstrip(".")


def inference_config(ds_config: dict) -> dict:
    """A copy of a built config for an inference-only engine: ZeRO-3 only, no optimizer/scheduler."""
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage != 3:
        raise DeepSpeedConfigError([("parallel.zero_stage", f"an inference-only DeepSpeed engine only makes "
                                     f"sense with ZeRO stage 3 (parameters partitioned), got {stage}")])
    config = copy.deepcopy(ds_config)
    for key in ("optimizer", "scheduler", "zero_force_ds_cpu_optimizer", "zero_allow_untested_optimizer"):
        config.pop(key, None)
    config.get("zero_optimization", {}).pop("offload_optimizer", None)
    return config
