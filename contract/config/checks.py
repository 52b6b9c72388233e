"""Checking a run config: the schema's own validation (pydantic: types, bounds, unknown keys) in
this project's words, paths made absolute, then the combinations that cannot work together (the
parallel layout, data sources, the spike guard)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from contract import validation_words

from contract.branches import names_branch, resume_problem
from contract import capabilities
from contract.capabilities import Feature, Layout, Method
from contract.config.schema import EVALUATORS, FUSED_METHODS, DataConfig, RunConfig
from contract.hub import is_hub_id


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
    problems = schema_problems(c)
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
    problems += capability_problems(c)
    if c.method.name in FUSED_METHODS:
        if isinstance(p.deepspeed, dict) and "optimizer" in p.deepspeed:
            problems.append(("parallel.deepspeed", f"{c.method.name} updates the weights itself; remove "
                             "the DeepSpeed \"optimizer\" section"))
        if p.offload_optimizer:
            problems.append(("parallel.offload_optimizer", f"{c.method.name} keeps no optimizer state to offload"))
        schedule = "checkpoint.every_n_steps" if c.checkpoint.every_n_steps else "checkpoint.every_n_epochs"
        if p.zero_stage == 3 and (c.checkpoint.every_n_steps or c.checkpoint.every_n_epochs):
            problems.append((schedule, f"{c.method.name} under ZeRO 3 cannot save training checkpoints: DeepSpeed's "
                             "ZeRO-3 engine writes the partitioned weights through an optimizer of its own, and "
                             f"{c.method.name} has none; use zero_stage 0, 1 or 2 for a run that saves training "
                             "checkpoints, or keep ZeRO 3 and save only the model (checkpoint.save_at_end)"))
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
    from contract.config.layout_checks import layout_problems  # torch-free: model config.json, hostfile
    problems += layout_problems(c)
    problems += guard_problems(c)
    from contract.config.preference_checks import preference_problems  # the objectives' refusals
    problems += preference_problems(c)
    return problems


SOURCE_KEYS = ("path", "format", "weight", "name")
SOURCE_FORMATS = ("auto", "text", "input_output", "chat", "tokenized", "preference", "unpaired")


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


def _layout(c: RunConfig) -> Layout:
    return Layout.of(c.parallel.tp_size, c.parallel.pp_size)


def capability_problems(c: RunConfig) -> list[tuple[str, str]]:
    """What the capability table (contract.capabilities) refuses of this run's layout, method
    and the features its settings ask for."""
    if c.method.name not in {m.value for m in Method}:
        return []  # an unknown method is the schema's problem, named there
    layout, method = _layout(c), c.method.name
    asked = [Feature.TRAIN]
    if c.train.grad_accum > 1:
        asked.append(Feature.GRAD_ACCUM)
    if c.data.batching == "packing":
        asked.append(Feature.PACKING)
    if c.model.quantization != "none":
        asked.append(Feature.QUANTIZED)
    found = [capabilities.problem(layout, method, feature) for feature in asked]
    if c.model.quantization != "none" and c.parallel.zero_stage == 3:
        # a value rule (the stage), so it stays here rather than in the table
        found.append(("model.quantization", "ZeRO-3 partitions every parameter into flat per-dtype shards; "
                      "transformers carries a 4-bit base through that only with bnb_4bit_quant_storage equal "
                      "to the compute dtype, on CUDA, loaded under ZeRO-3's construction context, which this "
                      "engine does not do (and never 8-bit); use zero_stage 0, 1 or 2 (the frozen base is "
                      "already small, ZeRO-2 partitions the adapter's gradients and optimizer state)"))
    return [p for p in found if p is not None]


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
        refused = capabilities.problem(_layout(c), c.method.name, Feature.GUARD_SKIP, field=key)
        if refused:
            problems.append(refused)
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


# -- the schema's validation, in this project's words --------------------------------------------

def build(raw: Any) -> tuple[RunConfig, list[tuple[str, str]]]:
    """A RunConfig from a nested dict, and every problem pydantic found, each naming its field.
    The fields at fault are left at their defaults, so the combination checks still run on the
    rest (every problem at once)."""
    if not isinstance(raw, dict):
        return RunConfig(), [("config", f"expected a mapping, got {raw!r}")]
    problems: list[tuple[str, str]] = []
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for _ in range(3):  # each round drops what the last one refused; nested faults need two
        try:
            return RunConfig.model_validate(raw), problems
        except ValidationError as e:
            found = [_in_words(err) for err in e.errors()]
            problems += [p for p in found if p not in problems]
            for err in e.errors():
                _drop(raw, err["loc"])
    return RunConfig(), problems


def schema_problems(c: RunConfig) -> list[tuple[str, str]]:
    """The schema's validation of a config built (or changed) in code: types and bounds."""
    raw = c.model_dump()
    try:
        RunConfig.model_validate(raw)
    except ValidationError as e:
        return [_in_words(err) for err in e.errors()]
    return []


def _drop(raw: dict, loc: tuple) -> None:
    node: Any = raw
    for part in loc[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        if not isinstance(node[part], dict):  # a section given as a non-mapping: drop it whole
            node.pop(part, None)
            return
        node = node[part]
    if isinstance(node, dict):
        node.pop(loc[-1], None)


def _in_words(err: ErrorDetails) -> tuple[str, str]:
    """A pydantic error as (config key, message): the one translator (contract.validation_words);
    the key is the section and field (`optim.lr`; an item of a list is its field's)."""
    found = validation_words.problem(err, RunConfig)
    field = found.name.replace("[", ".").split(".")[0]
    key = ".".join([*found.within, field] if field else found.within) or "config"
    return key, f"unknown key; {found.words}" if found.kind == "unknown" else found.words
