"""Which parallel layouts a run can use, checked before anything starts. Torch-free.

`layout_problems(cfg)` is part of the run config's validation (contract.config.checks.validate): it reads
the model's config.json (no torch, no transformers) and the hostfile, and returns every problem
as (field, message) with the reason, so a run that DeepSpeed or livetune cannot carry out is
refused with one message instead of failing minutes later on some rank.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from contract.hub import known_folder
from contract.model_facts import ModelFolderProblem, fact, read_model_config, tp_refusal
from contract.presets import MODEL_SIZE

# Decoder stacks whose layers share the call signature the pipeline split relies on
# (hidden, attention_mask, position_ids, cache, position_embeddings) and a rotary embedding.
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


def layout_problems(cfg: Any) -> list[tuple[str, str]]:
    """Problems of `cfg`'s tp / pp / multi-machine layout (a RunConfig; empty list when fine)."""
    p = cfg.parallel
    problems: list[tuple[str, str]] = []
    if p.tp_size > 1 and p.pp_size > 1:
        problems.append(("parallel.pp_size", "tensor and pipeline parallelism cannot be combined here: "
                         "DeepSpeed's AutoTP swaps the engine's model-parallel unit for its own "
                         "data x tensor mesh over all ranks, which knows nothing of pipeline stages; "
                         "use tp_size or pp_size, not both"))
    # which methods each layout trains: contract.capabilities (read by the config's own check)
    model = model_config(cfg)
    if model is not None:
        problems += _model_problems(model, p.tp_size, p.pp_size)
    problems += hostfile_problems(cfg)
    return problems


def model_config(cfg: Any) -> dict | None:
    """The model's config.json as a dict (its text part for multimodal configs); None when
    there is no readable one (the model.path check reports a missing folder)."""
    if not cfg.model.path:
        return {"model_type": "llama", "num_attention_heads": MODEL_SIZE["heads"],
                "num_key_value_heads": MODEL_SIZE["heads"], "num_hidden_layers": MODEL_SIZE["layers"]}
    try:
        return read_model_config(known_folder(cfg.model.path))
    except ModelFolderProblem:
        return None  # contract.preflight reports the folder's problem


def _model_problems(model: dict, tp: int, pp: int) -> list[tuple[str, str]]:
    problems = []
    heads = fact(model, "num_attention_heads")  # through the architecture's own name (GPT-2: n_head)
    kv_heads = fact(model, "num_key_value_heads") or heads
    refusal = tp_refusal(model) if tp > 1 else None
    if refusal:
        problems.append(("parallel.tp_size", refusal))
    elif tp > 1:
        if not isinstance(heads, int):
            problems.append(("parallel.tp_size", "the model's config.json gives no num_attention_heads, "
                             "so the attention cannot be split by heads"))
        elif heads % tp or (isinstance(kv_heads, int) and kv_heads % tp):
            problems.append(("parallel.tp_size", f"tp_size {tp} must divide the model's attention heads "
                             f"({heads}) and key/value heads ({kv_heads}): each rank holds whole heads"))
    if pp > 1:
        kind = model.get("model_type")
        if kind not in PIPELINE_MODEL_TYPES:
            problems.append(("parallel.pp_size", f"pipeline parallelism splits {', '.join(PIPELINE_MODEL_TYPES)} "
                             f"models (Llama-family decoders); this model is {kind!r}"))
        layers = fact(model, "num_hidden_layers")
        if isinstance(layers, int) and layers < pp:
            problems.append(("parallel.pp_size", f"pp_size {pp} stages need at least {pp} decoder layers; "
                             f"the model has {layers}"))
    return problems


def parse_hostfile(text: str) -> tuple[dict[str, int], list[str]]:
    """DeepSpeed's hostfile format ("host slots=N" per line, # comments) -> ({host: slots}, errors)."""
    hosts: dict[str, int] = {}
    errors = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        if not match:
            errors.append(f"line {number} {raw.strip()!r} is not `HOST slots=N`")
        elif match.group(1) in hosts:
            errors.append(f"line {number} names {match.group(1)} a second time")
        else:
            hosts[match.group(1)] = int(match.group(2))
    if not hosts and not errors:
        errors.append("it names no host")
    return hosts, errors


def hostfile_problems(cfg: Any) -> list[tuple[str, str]]:
    """The hostfile's format, its slots against nproc, and a rendezvous address the other
    machines can reach."""
    p = cfg.parallel
    if not p.hostfile or not Path(p.hostfile).is_file():
        return []  # a missing file is reported by the config's own check
    hosts, errors = parse_hostfile(Path(p.hostfile).read_text())
    problems = [("parallel.hostfile", f"{p.hostfile}: {e}") for e in errors]
    # each machine runs nproc ranks: fewer slots cannot hold them, and with more DeepSpeed would
    # start only nproc there, against the hostfile's word
    other = {h: n for h, n in hosts.items() if n != p.nproc}
    if other:
        given = ", ".join(f"{h} slots={n}" for h, n in other.items())
        problems.append(("parallel.nproc", f"parallel.nproc is {p.nproc} (ranks per machine), but the hostfile "
                         f"{p.hostfile} gives {given}: make every line's slots= equal nproc, or set nproc to "
                         "the slots"))
    if p.launcher != "deepspeed":
        problems.append(("parallel.launcher", f"a hostfile is read by the DeepSpeed launcher; "
                         f"{p.launcher} cannot use it (set launcher deepspeed)"))
    if len(hosts) > 1 and p.master_addr in LOOPBACK:
        problems.append(("parallel.master_addr", f"{p.master_addr} is this machine only; with "
                         f"{len(hosts)} machines give an address of the first host that the others reach"))
    return problems


def is_local_only(hosts: dict[str, int]) -> bool:
    """True when the hostfile names this machine alone (no ssh needed to start it)."""
    import socket
    names = {*LOOPBACK, socket.gethostname(), socket.getfqdn()}
    return len(hosts) == 1 and next(iter(hosts)) in names
