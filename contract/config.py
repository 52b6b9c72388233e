"""The run config: one typed schema for everything a run needs.

Each field is documented where it is declared (litgpt style); the front ends build their forms
from :func:`schema`, so a field added here shows up everywhere. This module imports neither torch
nor deepspeed, so the app process can use it.

Loading is strict: unknown keys, wrong types and impossible combinations are all collected and
reported in one :class:`ConfigError` that names every field at fault.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from contract.branches import names_branch, resume_problem
from contract.hub import is_hub_id


def _f(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with its documentation (and optional bounds) in the metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


METHODS = ("full", "lora", "prompt_tuning", "p_tuning", "lomo", "adalomo")
FUSED_METHODS = ("lomo", "adalomo")  # the update happens inside backward
PEFT_METHODS = ("lora", "prompt_tuning", "p_tuning")
# eval.evaluators values (engine.evaluators builds them; kept here so that validation stays torch-free)
EVALUATORS = ("perplexity", "choice", "exact_match", "generation")


@dataclass
class ModelConfig:
    path: str = _f("", "Local Hugging Face model folder, or a hub ID (owner/name) read from the Hugging "
                   "Face cache. Empty: the embedded tiny default model.", label="Model folder or hub ID")
    tokenizer: str = _f("", "Tokenizer folder or hub ID. Empty: the model's own tokenizer.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    attn_implementation: Literal["sdpa", "eager"] = _f("sdpa", "Attention kernel of the model.")
    trust_remote_code: bool = _f(False, "Allow model code shipped inside the model folder to run.")


@dataclass
class DataConfig:
    train: str = _f("", "Training data file or saved dataset folder (JSON lines, JSON, CSV, "
                    "Parquet, or `datasets` save_to_disk). Empty: the embedded default task.",
                    label="Training data")
    eval: str = _f("", "Evaluation data in the same formats. Empty with the default task: its "
                   "held-out split; empty otherwise: no evaluation data.", label="Evaluation data")
    format: Literal["auto", "text", "input_output", "chat", "tokenized"] = _f(
        "auto", "Row format: {text}, {input, output} (loss on output only), {messages} (chat "
        "template, loss on assistant turns), {input_ids, labels}; auto detects it from the keys.")
    max_length: int = _f(512, "Longest sample in tokens.", minimum=8)
    overlong: Literal["truncate", "drop", "error"] = _f(
        "truncate", "What to do with a sample longer than max_length (always counted and reported).")
    batching: Literal["random", "group_by_length", "packing"] = _f(
        "group_by_length", "How samples form batches: random order, batches of similar length "
        "(little padding), or several samples packed per row (per-sample attention and positions).")
    num_workers: int = _f(0, "Data loader worker processes (a run's training sources are drawn "
                          "in the main process, step by step: this applies to evaluation data).", minimum=0)
    sources: list[dict] = _f([], "Several training sources, each {path, format, weight, name}: a "
                             "file or saved dataset folder, its row format (auto by default), its "
                             "weight (>= 0; batches draw from the sources in proportion) and a name "
                             "(default: the file name). Empty: data.train is the one source.",
                             label="Training sources")


@dataclass
class TeachConfig:
    per_step: int = _f(4, "Samples of a taught answer in each of the next global batches.", minimum=1)
    steps: int = _f(20, "Batches a taught answer is mixed into.", minimum=1)
    check_after: int = _f(20, "Steps after a teach when the model is asked the prompt again "
                          "(greedy) and the old and new answers are recorded; 0: never.", minimum=0)
    max_new_tokens: int = _f(32, "Tokens generated for the answers before and after teaching.", minimum=1)


@dataclass
class MethodConfig:
    name: Literal["full", "lora", "prompt_tuning", "p_tuning", "lomo", "adalomo"] = _f(
        "full", "Fine-tuning method: all parameters with an optimizer, a PEFT adapter, or the "
        "fused low-memory LOMO / AdaLomo update.", label="Method")
    lora_r: int = _f(8, "LoRA rank.", minimum=1)
    lora_alpha: int = _f(16, "LoRA scaling numerator (scale = alpha / r).", minimum=1)
    lora_dropout: float = _f(0.0, "Dropout on the LoRA branch.", minimum=0.0, maximum=1.0)
    lora_target_modules: list[str] = _f([], "Module names LoRA wraps. Empty: inferred from the model.")
    num_virtual_tokens: int = _f(8, "Virtual tokens for prompt tuning / P-tuning.", minimum=1)
    adapter_name: str = _f("default", "Name of the trained adapter.")


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = _f("adamw", "Optimizer (ignored by LOMO / AdaLomo).", label="Optimizer")
    lr: float = _f(1e-3, "Peak learning rate.", minimum=0.0)
    weight_decay: float = _f(0.0, "Decoupled weight decay.", minimum=0.0)
    betas: list[float] = _f([0.9, 0.999], "Adam betas.")
    eps: float = _f(1e-8, "Adam epsilon.", minimum=0.0)
    scheduler: Literal["constant", "linear", "cosine"] = _f("cosine", "Learning-rate schedule after warmup.")
    warmup_steps: int = _f(0, "Linear warmup steps (wins over warmup_ratio when > 0).", minimum=0)
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total steps.", minimum=0.0, maximum=0.99)
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value; 0 disables.", minimum=0.0)


@dataclass
class TrainConfig:
    epochs: int = _f(1, "Passes over the training data (max_steps wins when > 0).", minimum=0)
    max_steps: int = _f(0, "Optimizer steps to train; 0: as many as the epochs give.", minimum=0)
    micro_batch_size: int = _f(8, "Samples per rank per forward pass.", minimum=1)
    grad_accum: int = _f(1, "Micro-batches accumulated per optimizer step.", minimum=1)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = _f(
        "auto", "Training precision; auto takes bf16 where the hardware does bf16 fast, else fp32.")
    seed: int = _f(42, "Seed of weights init, data order and dropout.")
    loss_average: Literal["tokens", "micro_batch"] = _f(
        "tokens", "The step's loss: tokens = the sum of the token losses over every micro-batch of the "
        "step on every data-parallel rank, divided by their number of label tokens (the Hugging Face "
        "Trainer's objective; the same whatever the split into micro-batches, accumulation and ranks); "
        "micro_batch = the mean of the micro-batches' mean losses (each micro-batch weighs the same).")


@dataclass
class ParallelConfig:
    nproc: int = _f(1, "Processes (ranks) on this machine.", minimum=1)
    zero_stage: int = _f(0, "DeepSpeed ZeRO stage: 0 off, 1 optimizer, 2 +gradients, 3 +parameters.",
                         minimum=0, maximum=3)
    offload_optimizer: bool = _f(False, "Keep optimizer state in CPU memory (ZeRO >= 1).")
    offload_param: bool = _f(False, "Keep parameters in CPU memory (ZeRO 3).")
    tp_size: int = _f(1, "Tensor-parallel size (DeepSpeed AutoTP).", minimum=1)
    pp_size: int = _f(1, "Pipeline-parallel size (DeepSpeed pipeline engine).", minimum=1)
    dp_size: int = _f(0, "Data-parallel size; 0: derived as world / (tp * pp).", minimum=0)
    pp_partition: Literal["parameters", "uniform"] = _f("parameters", "How pipeline stages are split.")
    launcher: Literal["deepspeed", "torchrun"] = _f("deepspeed", "Launcher that starts the ranks.")
    deepspeed: dict = _f({}, "A full DeepSpeed config (dict, or {file: path.json}); \"auto\" values "
                         "are filled from this run config, contradicting values are an error.")
    hostfile: str = _f("", "DeepSpeed hostfile for several machines. Empty: this machine only.")
    nodes: int = _f(1, "Machines the run spans when no hostfile lists them: a Slurm job's nodes "
                    "(set by submit --slurm, which starts nproc ranks on each).", minimum=1, label="Nodes")
    master_addr: str = _f("127.0.0.1", "Rendezvous address of rank 0.")
    master_port: int = _f(0, "Rendezvous port; 0 picks a free one.", minimum=0, maximum=65535)


@dataclass
class EvalConfig:
    every_n_steps: int = _f(0, "Evaluate every n optimizer steps; 0 never.", minimum=0)
    every_n_epochs: int = _f(0, "Evaluate every n epochs; 0 never.", minimum=0)
    at_end: bool = _f(True, "Evaluate once more when training ends (if there is evaluation data).")
    batch_size: int = _f(16, "Samples per rank per evaluation batch.", minimum=1)
    evaluators: list[str] = _f(["perplexity"], "Evaluators: perplexity (loss, perplexity); choice "
                               "(rows with choices: the lowest-loss candidate; accuracy, F1); "
                               "exact_match (generate and compare); generation (exact match, BLEU, "
                               "ROUGE, predictions saved in the run folder).")
    max_new_tokens: int = _f(32, "Tokens generated per sample by generating evaluators.", minimum=1)
    max_samples: int = _f(0, "Evaluate on at most this many samples; 0: all.", minimum=0)
    early_stopping_patience: int = _f(0, "Stop training after this many evaluations in a row "
                                      "without improvement of checkpoint.monitor; 0: never stop early.",
                                      minimum=0, label="Early stopping patience")
    early_stopping_threshold: float = _f(0.0, "How much checkpoint.monitor must improve on its best "
                                         "to count as an improvement (early stopping).", minimum=0.0,
                                         label="Early stopping threshold")


@dataclass
class CheckpointConfig:
    every_n_steps: int = _f(0, "Save a training checkpoint every n steps; 0 never.", minimum=0)
    every_n_epochs: int = _f(0, "Save a training checkpoint every n epochs; 0 never.", minimum=0)
    keep_last: int = _f(2, "Keep the newest k step checkpoints; 0 keeps all.", minimum=0)
    keep_best: int = _f(0, "Also keep the best k by `monitor`; 0 off.", minimum=0)
    monitor: str = _f("eval/loss", "Metric the best checkpoints are ranked by.")
    mode: Literal["min", "max"] = _f("min", "Whether smaller or larger `monitor` is better.")
    save_at_end: bool = _f(True, "Save the final model (Hugging Face format) when training ends.")
    load_best_at_end: bool = _f(False, "Reload the best checkpoint's weights at the end.")
    snapshots_keep: int = _f(2, "In-memory snapshots kept for instant rewinds (the `snapshot` "
                             "command); the oldest goes first; 0: snapshots off.", minimum=0,
                             maximum=1000, label="Snapshots kept")
    snapshots_max_mib: int = _f(0, "Most host memory (MiB, per machine) the snapshots may take "
                                "together; the oldest go first; 0: no bound but snapshots_keep.",
                                minimum=0, label="Snapshot memory (MiB)")


@dataclass
class LoggingConfig:
    output_dir: str = _f("runs", "Folder that holds the run folders.")
    run_name: str = _f("", "Name of this run's folder. Empty: a timestamp.")
    log_every_n_steps: int = _f(1, "Write a training record every n steps.", minimum=1)
    tensorboard: bool = _f(True, "Also write TensorBoard event files.")
    csv: bool = _f(False, "Also write train.csv and eval.csv (one row per record) in the run folder.",
                   label="CSV files")
    wandb: Literal["off", "offline", "online"] = _f("off", "Also log to Weights & Biases: offline writes "
                                                    "the run under <run folder>/wandb/ with no network "
                                                    "(wandb sync uploads it later); online needs wandb login.",
                                                    label="Weights & Biases")
    wandb_project: str = _f("livetune", "The W&B project the run is logged to.", label="W&B project")
    progress_bar: bool = _f(True, "Show a progress bar on rank 0 when attached to a terminal.")


@dataclass
class ControlConfig:
    enabled: bool = _f(True, "Open the control socket on rank 0 (chat, pause, set lr ...).",
                       label="Control socket on")
    host: str = _f("127.0.0.1", "Address the control socket listens on. Anything but loopback "
                   "must be opted into explicitly; every message still needs the run's token.")
    port: int = _f(0, "Control socket port; 0 picks a free one.", minimum=0, maximum=65535)
    chat_only: bool = _f(False, "Train nothing: hold the model (model.path, the checkpoint `resume` "
                         "names, or chat_load) in the engine for chat until stopped.", label="Chat only")
    chat_load: str = _f("", "With chat_only: a model folder, or a PEFT adapter folder on top of model.path, "
                        "loaded into the engine before chat starts.", label="Chat with (folder)")


@dataclass
class GuardConfig:
    """The spike guard (engine.spike_guard): every step's loss and gradient norm are judged, and
    a non-finite value, a loss spike or a gradient norm above the bound triggers an action."""
    enabled: bool = _f(False, "Judge every step and act by itself on a non-finite loss, a loss "
                       "spike or a gradient norm above grad_norm_max.", label="Spike guard on")
    warmup_steps: int = _f(10, "Steps whose loss only feeds the spike statistic before spikes are "
                           "judged (non-finite values and the norm bound count from step 1).",
                           minimum=0, label="Guard warm-up steps")
    window: int = _f(20, "The spike statistic is taken over the losses of the last n accepted steps.",
                     minimum=3, maximum=10000, label="Spike window (steps)")
    spike_z: float = _f(6.0, "A loss spikes when it is above the window's median by more than spike_z "
                        "times its noise (a robust standard deviation of the step-to-step changes) ...",
                        minimum=0.0, label="Spike threshold (robust z)")
    spike_ratio: float = _f(1.2, "... and at least spike_ratio x the median (a nearly flat loss then "
                            "does not make every wiggle a spike); 1: the z threshold alone.",
                            minimum=1.0, label="Spike ratio to the median")
    grad_norm_max: float = _f(0.0, "Bound on the global gradient norm (before clipping); 0: off.",
                              minimum=0.0, label="Gradient norm bound")
    on_nonfinite: Literal["skip", "rewind", "pause"] = _f(
        "skip", "Action on a non-finite loss: skip the update, rewind to the newest good checkpoint "
        "or snapshot (lr x lr_scale), or pause and notify.", label="On a non-finite loss")
    on_spike: Literal["skip", "rewind", "pause"] = _f("skip", "Action on a loss spike (as on_nonfinite).",
                                                      label="On a loss spike")
    on_grad_norm: Literal["rewind", "pause"] = _f(
        "rewind", "Action on a gradient norm above the bound, or non-finite. The norm is known only "
        "once the update is applied, so it cannot be skipped.", label="On a gradient norm")
    lr_scale: float = _f(0.5, "Factor on the learning rate at each guard rewind.", minimum=0.0,
                         maximum=1.0, label="Learning-rate factor per rewind")
    max_rewinds: int = _f(3, "Guard rewinds in the whole run; once spent, a trigger that would "
                          "rewind pauses instead.", minimum=0, label="Most guard rewinds")
    max_skips_in_a_row: int = _f(5, "Skipped steps in a row after which the guard pauses instead "
                                 "(a run whose every step spikes is not training).", minimum=1,
                                 label="Most skips in a row")
    snapshot_every_n_steps: int = _f(0, "Take an in-memory snapshot every n steps for the guard to "
                                     "rewind to (fast, no disk); 0: off (it rewinds to checkpoints "
                                     "and to the snapshots you take).", minimum=0,
                                     label="Guard snapshot every N steps")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    teach: TeachConfig = field(default_factory=TeachConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    resume: str = _f("", "Continue from a training checkpoint folder, `latest` in the run folder (the "
                     "present branch's newest), or a branch's name (its newest checkpoint).",
                     label="Resume from checkpoint")

    # -- derived values -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        nodes = _hostfile_nodes(self.parallel.hostfile) if self.parallel.hostfile else self.parallel.nodes
        return self.parallel.nproc * max(1, nodes)

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.parallel.tp_size * self.parallel.pp_size)

    @property
    def uses_default_task(self) -> bool:
        return not self.data.train and not self.data.sources

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# The most used settings, short whatever the nesting: `./launch.sh train max_steps=40 nproc=2`.
SHORTCUTS = {
    "max_steps": "train.max_steps",
    "epochs": "train.epochs",
    "nproc": "parallel.nproc",
    "zero_stage": "parallel.zero_stage",
    "tp": "parallel.tp_size",
    "pp": "parallel.pp_size",
    "seed": "train.seed",
    "lr": "optim.lr",
    "output_dir": "logging.output_dir",
    "run_name": "logging.run_name",
    "method": "method.name",
    "precision": "train.precision",
    "model": "model.path",
    "batch_size": "train.micro_batch_size",
}


class ConfigError(ValueError):
    """Every problem of a config at once; `problems` is a list of (field, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"  - {key}: {msg}" for key, msg in problems)
        super().__init__(f"invalid run config ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


# -- loading ------------------------------------------------------------------------------------

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


def _hostfile_nodes(hostfile: str) -> int:
    if not hostfile or not Path(hostfile).is_file():
        return 1
    lines = [ln.split("#")[0].strip() for ln in Path(hostfile).read_text().splitlines()]
    return max(1, sum(1 for ln in lines if ln))


# -- validation ---------------------------------------------------------------------------------

def _absolute(value: str) -> str:
    if not value or "://" in value:  # empty (a default applies) or an fsspec URL
        return value
    return str(Path(value).expanduser().resolve())


def absolute_paths(c: RunConfig) -> None:
    """Make every path of the config absolute against the directory it was given in: the engine
    processes start in the project folder, and the saved config.yaml must mean the same files
    wherever it is read again (resume, the app)."""
    c.model.path, c.model.tokenizer = (p if is_hub_id(p) else _absolute(p) for p in (c.model.path, c.model.tokenizer))
    c.data.train, c.data.eval = _absolute(c.data.train), _absolute(c.data.eval)
    c.data.sources = [{**s, "path": _absolute(s["path"])} if isinstance(s.get("path"), str) else s
                      for s in c.data.sources]
    c.logging.output_dir = _absolute(c.logging.output_dir)
    c.control.chat_load = _absolute(c.control.chat_load)
    c.parallel.hostfile = _absolute(c.parallel.hostfile)
    if c.resume != "latest" and not names_branch(c.resume):  # a branch name stays a name
        c.resume = _absolute(c.resume)
    if isinstance(c.parallel.deepspeed, dict) and isinstance(c.parallel.deepspeed.get("file"), str):
        c.parallel.deepspeed = {**c.parallel.deepspeed, "file": _absolute(c.parallel.deepspeed["file"])}


def validate(c: RunConfig) -> list[tuple[str, str]]:
    """Bounds of single fields, then the combinations that cannot work together."""
    problems = _check_bounds(c, "")
    p, t = c.parallel, c.train
    if p.nproc % (p.tp_size * p.pp_size):
        problems.append(("parallel.nproc", f"{p.nproc} processes cannot be split into tp_size "
                         f"{p.tp_size} x pp_size {p.pp_size}; nproc must be a multiple of {p.tp_size * p.pp_size}"))
    elif p.dp_size and p.dp_size * p.tp_size * p.pp_size != c.world_size:
        problems.append(("parallel.dp_size", f"dp_size {p.dp_size} x tp_size {p.tp_size} x pp_size "
                         f"{p.pp_size} must equal the world size {c.world_size} (or set dp_size 0)"))
    if p.tp_size > 1 and p.zero_stage == 3:
        problems.append(("parallel.tp_size", "DeepSpeed AutoTP training works with ZeRO 0, 1 and 2, not 3"))
    if p.pp_size > 1 and p.zero_stage > 1:
        problems.append(("parallel.pp_size", "the DeepSpeed pipeline engine supports ZeRO 0 and 1 only"))
    if p.offload_optimizer and p.zero_stage == 0:
        problems.append(("parallel.offload_optimizer", "needs zero_stage 1, 2 or 3"))
    if p.offload_param and p.zero_stage != 3:
        problems.append(("parallel.offload_param", "needs zero_stage 3"))
    if c.method.name in FUSED_METHODS:
        if p.pp_size > 1:
            problems.append(("method.name", f"{c.method.name} updates inside backward and cannot run "
                             "with pipeline parallelism (parallel.pp_size > 1)"))
        if t.grad_accum > 1:
            problems.append(("train.grad_accum", f"{c.method.name} applies each gradient as soon as it "
                             "is computed, so gradients cannot be accumulated; set grad_accum 1"))
        if isinstance(p.deepspeed, dict) and "optimizer" in p.deepspeed:
            problems.append(("parallel.deepspeed", f"{c.method.name} updates the weights itself; remove "
                             "the DeepSpeed \"optimizer\" section"))
        if p.offload_optimizer:
            problems.append(("parallel.offload_optimizer", f"{c.method.name} keeps no optimizer state to offload"))
    if c.method.name in ("prompt_tuning", "p_tuning") and c.data.batching == "packing":
        problems.append(("data.batching", f"{c.method.name} puts virtual tokens in front of each row and "
                         "drops position_ids, which packed rows need to keep samples apart; use "
                         "group_by_length or random"))
    if t.max_steps == 0 and t.epochs == 0:
        problems.append(("train.max_steps", "set max_steps or epochs above 0"))
    evaluates = c.eval.every_n_steps or c.eval.every_n_epochs
    if evaluates and not c.data.eval and not c.uses_default_task:
        problems.append(("eval.every_n_steps" if c.eval.every_n_steps else "eval.every_n_epochs",
                         "evaluation is scheduled but data.eval names no evaluation data"))
    if c.control.chat_only and not c.control.enabled:
        problems.append(("control.chat_only", "chat goes through the control socket: set control.enabled"))
    if c.control.chat_load and not c.control.chat_only:
        problems.append(("control.chat_load", "is for chat-only runs: set control.chat_only"))
    if c.eval.early_stopping_patience and not evaluates:
        problems.append(("eval.early_stopping_patience", "early stopping watches evaluations: set "
                         "eval.every_n_steps or eval.every_n_epochs"))
    if c.eval.early_stopping_patience and not c.checkpoint.monitor:
        problems.append(("checkpoint.monitor", "early stopping needs a metric to watch"))
    if c.checkpoint.keep_best and not c.checkpoint.monitor:
        problems.append(("checkpoint.monitor", "keep_best needs a metric to rank by"))
    if c.resume == "latest" and not c.logging.run_name:
        problems.append(("resume", "`latest` is the newest checkpoint of a run folder: name the run to "
                         "continue with logging.run_name (run_name=...), or give a checkpoint path"))
    elif names_branch(c.resume):
        problem = resume_problem(c.logging.output_dir, c.logging.run_name, c.resume)
        if problem:
            problems.append(("resume", problem))
    elif c.resume and c.resume != "latest" and "://" not in c.resume and not Path(c.resume).exists():
        problems.append(("resume", f"no such checkpoint folder: {c.resume}"))
    if len(c.optim.betas) != 2:
        problems.append(("optim.betas", f"expected two numbers, got {c.optim.betas}"))
    for name in c.eval.evaluators:
        if name not in EVALUATORS:
            problems.append(("eval.evaluators", f"unknown evaluator {name!r}; allowed: {', '.join(EVALUATORS)}"))
    if c.control.host not in ("127.0.0.1", "localhost", "::1") and not p.hostfile and p.nodes == 1:
        problems.append(("control.host", "listening beyond loopback is for multi-machine runs; set "
                         "parallel.hostfile (or parallel.nodes, which submit --slurm sets)"))
    if p.hostfile and p.nodes != 1:
        problems.append(("parallel.nodes", "the hostfile says which machines the run spans; leave nodes at 1"))
    for key, folder in (("model.path", c.model.path), ("model.tokenizer", c.model.tokenizer)):
        if is_hub_id(folder):  # a hub ID: the pre-flight check looks in the cache (contract.hub)
            continue
        if folder and not Path(folder).is_dir():
            problems.append((key, f"no such folder: {folder} (nor a hub ID such as owner/name)"))
    for key, data_path in (("data.train", c.data.train), ("data.eval", c.data.eval)):
        if data_path and not Path(data_path).exists():
            problems.append((key, f"no such file or folder: {data_path}"))
    problems += source_problems(c.data)
    if p.hostfile and not Path(p.hostfile).is_file():
        problems.append(("parallel.hostfile", f"no such file: {p.hostfile}"))
    from contract.layout_checks import layout_problems  # torch-free: model config.json, hostfile
    problems += layout_problems(c)
    problems += guard_problems(c)
    return problems


SOURCE_KEYS = ("path", "format", "weight", "name")
SOURCE_FORMATS = ("auto", "text", "input_output", "chat", "tokenized")


def source_problems(d: DataConfig) -> list[tuple[str, str]]:
    """Each `data.sources` entry: a mapping with an existing path, a known format, a finite
    weight >= 0 and a unique name; at least one weight above 0; not together with data.train."""
    import math
    problems: list[tuple[str, str]] = []
    if d.sources and d.train:
        problems.append(("data.sources", "give data.train (one source) or data.sources, not both"))
    names: set[str] = set()
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        unknown = [k for k in s if k not in SOURCE_KEYS]
        if unknown:
            problems.append((key, f"unknown key {', '.join(map(str, unknown))}; allowed: {', '.join(SOURCE_KEYS)}"))
        path = s.get("path")
        if not isinstance(path, str) or not path:
            problems.append((f"{key}.path", "a file or saved dataset folder is needed"))
        elif "://" not in path and not Path(path).exists():
            problems.append((f"{key}.path", f"no such file or folder: {path}"))
        if s.get("format", "auto") not in SOURCE_FORMATS:
            problems.append((f"{key}.format", f"must be one of {', '.join(SOURCE_FORMATS)}, got {s.get('format')!r}"))
        weight = s.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            problems.append((f"{key}.weight", f"must be a number >= 0 (0 pauses the source), got {weight!r}"))
        name = source_name(s, i)
        if name in names:
            problems.append((f"{key}.name", f"{name!r} names two sources; give each its own name"))
        names.add(name)
    weights = [s.get("weight", 1.0) for s in d.sources]
    if d.sources and not any(isinstance(w, (int, float)) and w > 0 for w in weights):
        problems.append(("data.sources", "at least one source needs a weight above 0"))
    return problems


def source_name(source: dict, index: int) -> str:
    """A source's name: its `name`, else its file's stem, else source<index>."""
    name = source.get("name")
    if isinstance(name, str) and name:
        return name
    path = source.get("path")
    return Path(path).stem if isinstance(path, str) and path else f"source{index}"


def guard_problems(c: RunConfig) -> list[tuple[str, str]]:
    """What the spike guard cannot do in this run: skipping needs the update to wait for the
    loss (the engine step, one micro-batch per step); rewind and pause act through the control plane."""
    g = c.guard
    if not g.enabled:
        return []
    problems = []
    actions = {"guard.on_nonfinite": g.on_nonfinite, "guard.on_spike": g.on_spike}
    for key, action in actions.items():
        if action != "skip":
            continue
        if c.method.name in FUSED_METHODS:
            problems.append((key, f"skip needs the update to wait for the guard, but {c.method.name} "
                             "updates inside backward; choose rewind or pause"))
        elif c.parallel.pp_size > 1:
            problems.append((key, "skip needs the update to wait for the guard, but the pipeline schedule "
                             "runs forward, backward and update in one call; choose rewind or pause"))
        elif c.train.grad_accum > 1:
            problems.append((key, "skip judges the loss before the backward, which needs train.grad_accum 1 "
                             "(earlier micro-batches would be accumulated already); choose rewind or pause"))
    if g.grad_norm_max > 0:  # (a non-finite norm without the control plane is only reported)
        actions["guard.on_grad_norm"] = g.on_grad_norm
    acting = [k for k, a in actions.items() if a != "skip"]
    if acting and not c.control.enabled:
        other = "set guard.grad_norm_max 0" if acting[0] == "guard.on_grad_norm" else "choose skip"
        problems.append((acting[0], f"rewind and pause act through the control plane; set control.enabled "
                         f"true, or {other}"))
    if g.lr_scale <= 0:
        problems.append(("guard.lr_scale", f"must be above 0 (a rate of 0 cannot be scaled back), got {g.lr_scale}"))
    if g.snapshot_every_n_steps and not c.checkpoint.snapshots_keep:
        problems.append(("guard.snapshot_every_n_steps", "snapshots are off (checkpoint.snapshots_keep 0); "
                         "keep at least 1, or set 0 here"))
    return problems


def _check_bounds(obj: Any, prefix: str) -> list[tuple[str, str]]:
    problems = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            problems += _check_bounds(value, key + ".")
            continue
        lo, hi = f.metadata.get("minimum"), f.metadata.get("maximum")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if lo is not None and value < lo:
                problems.append((key, f"must be at least {lo}, got {value}"))
            if hi is not None and value > hi:
                problems.append((key, f"must be at most {hi}, got {value}"))
    return problems


# -- the schema the front ends build their forms from ------------------------------------------

def schema() -> list[dict]:
    """One entry per leaf field: key, group, kind, default, label (a human name: the field's
    `label=`, else `field_label`), help, choices, minimum, maximum."""
    entries = []
    hints = typing.get_type_hints(RunConfig)
    for section in dataclasses.fields(RunConfig):
        tp = hints[section.name]
        if dataclasses.is_dataclass(tp):
            sub_hints = typing.get_type_hints(tp)
            for f in dataclasses.fields(tp):
                entries.append(_entry(f"{section.name}.{f.name}", section.name, f, sub_hints[f.name]))
        else:
            entries.append(_entry(section.name, "run", section, tp))
    return entries


def _entry(key: str, group: str, f: dataclasses.Field, tp: Any) -> dict:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    origin = typing.get_origin(tp)
    kind = ("choice" if origin is Literal else "list" if origin is list else
            {bool: "bool", int: "int", float: "float", str: "str", dict: "dict"}.get(tp, "str"))
    return {"key": key, "group": group, "kind": kind, "default": default,
            "label": f.metadata.get("label") or field_label(key), "help": f.metadata.get("help", ""),
            "choices": list(typing.get_args(tp)) if origin is Literal else None,
            "minimum": f.metadata.get("minimum"), "maximum": f.metadata.get("maximum")}


# words a field's name abbreviates, spelled out in its human label
_LABEL_WORDS = {"lr": "learning rate", "tp": "tensor parallel", "pp": "pipeline parallel", "dp": "data parallel",
                "nproc": "processes (ranks)", "grad": "gradient", "accum": "accumulation", "attn": "attention",
                "lora": "LoRA", "zero": "ZeRO", "eps": "epsilon", "n": "N", "max": "max", "num": "number of",
                "r": "rank", "tensorboard": "TensorBoard", "deepspeed": "DeepSpeed config (JSON)", "addr": "address"}


def field_label(key: str) -> str:
    """A field's human label from its name, where its declaration gives none (`label=`):
    `train.grad_accum` -> "Gradient accumulation"."""
    words = [_LABEL_WORDS.get(w, w) for w in key.rsplit(".", 1)[-1].split("_")]
    text = " ".join(words)
    return text[0].upper() + text[1:]


def get_value(config: RunConfig, key: str) -> Any:
    obj: Any = config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
