"""The pre-flight check: everything that can be known about a run before any rank starts, found
at once and named by field, file and row. Torch-free; every entry point runs it (the terminal,
`supervisor.RunManager.start` and so the web app, the notebook, scripts and Slurm submissions,
and the web form to disable Start).

    report = preflight(cfg)          # never raises for bad input: it reports it
    if not report.ok:
        raise PreflightError(report.problems)
    print(report.text())             # notes, warnings (dropped and truncated rows), problems

It checks the run config (contract.config.checks.validate, which includes the parallel layout against
the model's config.json read through the architecture's own names: contract.model_facts); the
DeepSpeed config after "auto" filling (contract.deepspeed_config, the builder the engine runs);
the model folder (config.json present and valid, weights, tokenizer files, a chat template when
the data is chat); and every data file (contract.data_check: readable, UTF-8, one format, rows
counted, dropped rows by number, truncated rows estimated without tokenizing the file).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from contract import hub
from contract.config.schema import ConfigError, RunConfig
from contract.config.checks import validate
from contract.data_check import (LOUD_TRUNCATION_SHARE, DataScan, chars_per_token, named_rows,
                                 objective_problem, overlong_rows, scan_file)
from contract.data_rows import DataError
from contract.deepspeed_config import build_ds_config
from contract.lm_eval_names import task_problems
from contract.model_facts import ModelFolderProblem, fact, read_model_config
from contract.presets import MODEL_SIZE

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt",
                   "sentencepiece.bpe.model")
Finding = tuple[str, str]  # (field, message), as ConfigError names problems


class PreflightError(ConfigError):
    """A run refused before start; `problems` names each (field, message)."""

    def __init__(self, problems: list[Finding]):
        super().__init__(problems)
        n = len(problems)
        lines = "\n".join(f"  - {key}: {msg}" for key, msg in problems)
        self.args = (f"the run cannot start ({n} problem{'s' * (n != 1)}, found before any rank started):\n{lines}",)


@dataclass
class PreflightReport:
    """What the check found. `problems` refuse the run; `warnings` do not (dropped rows,
    truncation); `loud` are warnings to say loudly (more than LOUD_TRUNCATION_SHARE of a file's
    rows truncated), kept apart from `warnings`; `notes` are facts (rows, format)."""
    problems: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    loud: list[Finding] = field(default_factory=list)
    notes: list[Finding] = field(default_factory=list)
    fingerprint: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        """Every finding, one line each: notes, warnings, then the problems."""
        lines = [f"{k}: {m}" for k, m in self.notes]
        lines += [f"WARNING {k}: {m}" for k, m in self.loud]
        lines += [f"warning {k}: {m}" for k, m in self.warnings]
        if self.problems:
            lines.append(str(PreflightError(self.problems)))
        return "\n".join(lines)


def fingerprint(cfg: RunConfig) -> str:
    """The config a report belongs to (a report is reused only for an equal config)."""
    return json.dumps(cfg.to_dict(), sort_keys=True, default=str)


def check_before_start(cfg: RunConfig) -> PreflightReport:
    """preflight(cfg), raising PreflightError when anything refuses the run."""
    report = preflight(cfg)
    if not report.ok:
        raise PreflightError(report.problems)
    return report


def preflight(cfg: RunConfig) -> PreflightReport:
    """Check `cfg` and every file it names; all findings, none raised."""
    report = PreflightReport(problems=list(validate(cfg)), fingerprint=fingerprint(cfg))
    model = _model_folder(cfg, report)
    scans = _data_files(cfg, model, report)
    _objective_and_batch(cfg, scans, report)
    train = scans.get("data.train")
    chat_source = any(s.format == "chat" for k, s in scans.items() if k.startswith("data.sources"))
    if train is not None and train.format == "chat" or cfg.data.format == "chat" or chat_source:
        _chat_template(cfg, report)
    report.problems += _deepspeed(cfg, model, train, report)
    _monitor_packages(cfg, report)
    _attention(cfg, report)
    report.problems += task_problems(cfg.eval.lm_eval_tasks)  # a bad name would end the run at its first evaluation
    report.problems = list(dict.fromkeys(report.problems))  # a finding said once
    return report


def _hub_folder(path: str, key: str, report: PreflightReport) -> Path | None:
    """The local folder of `path`: itself, or a hub ID's snapshot in the Hugging Face cache (None,
    reported, when the cache lacks it offline; noted when it will be downloaded at start)."""
    if not hub.is_hub_id(path):
        return Path(path)
    folder = hub.cached_folder(path)
    if folder is not None:
        report.notes.append((key, f"{path}: read from the Hugging Face cache ({folder})"))
    elif hub.offline():
        report.problems.append((key, hub.missing_message(path)))
    else:
        report.notes.append((key, f"{path} is not in the Hugging Face cache ({hub.cache_dir()}): the "
                             "ranks download it when the run starts"))
    return folder


def _monitor_packages(cfg: RunConfig, report: PreflightReport) -> None:
    """A monitor back end whose package is missing would fail rank 0 alone, after the others started."""
    if cfg.logging.wandb != "off" and importlib.util.find_spec("wandb") is None:
        report.problems.append(("logging.wandb", f"{cfg.logging.wandb} needs the wandb package, which is not "
                                "installed: pip install wandb, or set logging.wandb=off"))


def _attention(cfg: RunConfig, report: PreflightReport) -> None:
    """flash_attention_2 needs the flash_attn package on the ranks (missing, every rank would fail
    while building the model) and half precision (its kernels take bf16 / fp16 only)."""
    if cfg.model.attn_implementation != "flash_attention_2":
        return
    if importlib.util.find_spec("flash_attn") is None:
        report.problems.append(("model.attn_implementation", "flash_attention_2 needs the flash_attn package, "
                                "which is not installed: pip install flash-attn (a CUDA GPU), or set "
                                "model.attn_implementation=sdpa"))
    if cfg.train.precision == "fp32":
        report.problems.append(("model.attn_implementation", "flash_attention_2 runs in bf16 or fp16 only, "
                                "and train.precision is fp32: set train.precision=auto (bf16 on a GPU that "
                                "has it), or model.attn_implementation=sdpa"))


# -- the model folder ---------------------------------------------------------------------------

def _model_folder(cfg: RunConfig, report: PreflightReport) -> dict | None:
    """The model's config.json (the embedded default's facts without model.path); None when it
    cannot be read (reported)."""
    if not cfg.model.path:
        return {"model_type": "llama", "hidden_size": MODEL_SIZE["hidden"],
                "max_position_embeddings": MODEL_SIZE["positions"]}
    if cfg.model.tokenizer:
        _hub_folder(cfg.model.tokenizer, "model.tokenizer", report)
    folder = _hub_folder(cfg.model.path, "model.path", report)
    if folder is None or not folder.is_dir():
        return None  # validate() said "no such folder", or the hub ID is not in the cache
    try:
        model = read_model_config(folder)
    except ModelFolderProblem as e:
        report.problems.append(("model.path", str(e)))
        model = None
    if model is not None and not any((folder / name).exists() for name in WEIGHT_FILES):
        report.warnings.append(("model.path", f"{folder} holds no weights ({', '.join(WEIGHT_FILES)}): "
                                "the model is built from its config.json with random weights "
                                f"(seed {cfg.train.seed})"))
    tok_key, tok_folder = _tokenizer_folder(cfg)
    if tok_folder.is_dir() and not any((tok_folder / name).exists() for name in TOKENIZER_FILES):
        report.problems.append((tok_key, f"{tok_folder} holds no tokenizer (none of "
                                f"{', '.join(TOKENIZER_FILES)}); save one there with "
                                "save_pretrained, or name a tokenizer folder in model.tokenizer"))
    return model


def _tokenizer_folder(cfg: RunConfig) -> tuple[str, Path]:
    key, path = ("model.tokenizer", cfg.model.tokenizer) if cfg.model.tokenizer else ("model.path", cfg.model.path)
    return key, hub.known_folder(path)


def _chat_template(cfg: RunConfig, report: PreflightReport) -> None:
    if not cfg.model.path and not cfg.model.tokenizer:
        return  # the embedded default's tokenizer has one
    key, folder = _tokenizer_folder(cfg)
    if not folder.is_dir():
        return
    if (folder / "chat_template.jinja").exists() or (folder / "chat_template.json").exists():
        return
    try:
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        settings = {}
    if isinstance(settings, dict) and settings.get("chat_template"):
        return
    report.problems.append(("data.format", f"the data is chat (rows with 'messages'), but the tokenizer "
                            f"in {folder} ({key}) has no chat template (no chat_template in "
                            "tokenizer_config.json, no chat_template.jinja); add one, or use "
                            "input_output rows"))


# -- the data files -----------------------------------------------------------------------------

def _data_files(cfg: RunConfig, model: dict | None, report: PreflightReport) -> dict[str, DataScan]:
    scans = {}
    for key in ("data.train", "data.eval"):
        path = getattr(cfg.data, key.split(".")[1])
        if not path or "://" in path or not Path(path).exists():
            continue  # empty: the default task; missing: validate() said so
        try:
            scan = scan_file(path, cfg.data.format)
        except DataError as e:
            report.problems.append((key, str(e).removeprefix("data: ")))
            continue
        scans[key] = scan
        _rows_findings(cfg, key, scan, report)
    for i, source in enumerate(cfg.data.sources):  # each of several sources, in its own format
        key, path = f"data.sources[{i}]", source.get("path")
        if not isinstance(path, str) or "://" in path or not Path(path).exists():
            continue  # validate() said so
        try:
            scan = scan_file(path, source.get("format", "auto"))
        except DataError as e:
            report.problems.append((key, str(e).removeprefix("data: ")))
            continue
        scans[key] = scan
        _rows_findings(cfg, key, scan, report)
    return scans


def _rows_findings(cfg: RunConfig, key: str, scan: DataScan, report: PreflightReport) -> None:
    usable = len(scan.chars)
    report.notes.append((key, f"{scan.path}: {scan.rows} rows, format {scan.format}, {usable} usable"))
    if scan.dropped:
        reasons = "; ".join(f"row {n}: {why}" for n, why in scan.dropped[:5])
        more = f"; ... ({named_rows([n for n, _ in scan.dropped])})" if len(scan.dropped) > 5 else ""
        finding = (key, f"{scan.path}: {len(scan.dropped)} of {scan.rows} rows will be dropped: {reasons}{more}")
        (report.warnings if usable else report.problems).append(finding)
    if not usable:
        report.problems.append((key, f"{scan.path}: no usable row (format {scan.format})"))
        return
    tok_folder = None if not (cfg.model.path or cfg.model.tokenizer) else str(_tokenizer_folder(cfg)[1])
    ratio, how = (1.0, "counted exactly (pre-tokenized rows)") if scan.exact_tokens else chars_per_token(tok_folder, scan)
    over = overlong_rows(scan, cfg.data.max_length, ratio)
    if not over:
        return
    share = len(over) / usable
    fate = {"truncate": "will be truncated", "drop": "will be dropped", "error": "are refused"}[cfg.data.overlong]
    message = (f"{scan.path}: about {len(over)} of {usable} rows ({share:.0%}) are longer than "
               f"data.max_length={cfg.data.max_length} tokens and {fate} ({named_rows(over)}); {how}")
    if cfg.data.overlong == "error":
        report.problems.append(("data.max_length", message + "; raise data.max_length or set data.overlong"))
        return
    if share > LOUD_TRUNCATION_SHARE:
        report.loud.append(("data.max_length", message + f" -- more than {LOUD_TRUNCATION_SHARE:.0%}: "
                            "raise data.max_length if the model's context allows"))
    else:
        report.warnings.append(("data.max_length", message))


def _objective_and_batch(cfg: RunConfig, scans: dict[str, DataScan], report: PreflightReport) -> None:
    """The training files' detected formats against the objective (the ranks would refuse them
    after start), and their usable rows against one global batch (micro_batch_size x data-parallel
    ranks: the training sampler leaves an incomplete batch out, so fewer rows train nothing)."""
    training = {k: s for k, s in scans.items() if k != "data.eval"}
    for key, scan in training.items():
        problem = objective_problem(cfg.preference.objective, scan.format, scan.path)
        if problem:
            report.problems.append((key, problem))
    if not training or cfg.dp_size < 1 or any(k.startswith(("data.train", "data.sources")) for k, _ in report.problems):
        return  # a file already refused (unreadable, no usable row, the wrong rows): that is the news
    usable = sum(_trained_rows(cfg, s) for s in training.values())
    needed = cfg.train.micro_batch_size * cfg.dp_size
    if 0 < usable < needed:
        where = "data.train" if "data.train" in training else "data.sources"
        files = ", ".join(s.path for s in training.values())
        report.problems.append((where, f"{files}: {usable} usable row{'s' * (usable != 1)}, fewer than one "
                                f"global batch of {needed} (train.micro_batch_size {cfg.train.micro_batch_size}"
                                f" x {cfg.dp_size} data-parallel rank{'s' * (cfg.dp_size != 1)}): give at "
                                "least that many rows, or lower train.micro_batch_size"))


def _trained_rows(cfg: RunConfig, scan: DataScan) -> int:
    """A file's usable rows, less those data.overlong=drop will drop (estimated as the warning is)."""
    if cfg.data.overlong != "drop" or not scan.chars:
        return len(scan.chars)
    tok_folder = None if not (cfg.model.path or cfg.model.tokenizer) else str(_tokenizer_folder(cfg)[1])
    ratio = 1.0 if scan.exact_tokens else chars_per_token(tok_folder, scan)[0]
    return len(scan.chars) - len(overlong_rows(scan, cfg.data.max_length, ratio))


# -- DeepSpeed ----------------------------------------------------------------------------------

def _deepspeed(cfg: RunConfig, model: dict | None, train: DataScan | None,
               report: PreflightReport) -> list[Finding]:
    """The DeepSpeed config's contradictions with the run config, after "auto" filling."""
    if cfg.dp_size < 1 or cfg.world_size % (cfg.parallel.tp_size * cfg.parallel.pp_size):
        return []  # the layout itself is wrong: validate() said so
    hidden = (fact(model, "hidden_size") or model.get("d_model")) if model else None
    total, estimated = _total_steps(cfg, train)
    warmup = cfg.optim.warmup_steps or int(cfg.optim.warmup_ratio * total)
    # "auto" precision resolves on the ranks' hardware: a clash counts when every outcome has it
    precisions = ("bf16", "fp32") if cfg.train.precision == "auto" else (cfg.train.precision,)
    found: list[list[Finding]] = []
    for precision in precisions:
        try:
            build_ds_config(cfg, world_size=cfg.world_size, dp_size=cfg.dp_size, total_steps=total,
                            warmup_steps=warmup, hidden_size=hidden if isinstance(hidden, int) else None,
                            precision=precision)
            found.append([])
        except ConfigError as e:
            found.append(list(e.problems))
    keys_everywhere = set.intersection(*({k for k, _ in f} for f in found))
    problems = [p for p in found[0] if p[0] in keys_everywhere]
    if estimated:  # the step count is only known once the data is tokenized: no clash claimed on it
        vague = ("total_num_steps",) + (("warmup_num_steps",) if not cfg.optim.warmup_steps else ())
        problems = [p for p in problems if not p[0].endswith(vague)]
    return problems


def _total_steps(cfg: RunConfig, train: DataScan | None) -> tuple[int, bool]:
    """Optimizer steps (max_steps, or estimated from the usable rows) and whether estimated."""
    if cfg.train.max_steps:
        return cfg.train.max_steps, False
    rows = len(train.chars) if train is not None else 0
    per_step = cfg.train.micro_batch_size * max(1, cfg.dp_size) * cfg.train.grad_accum
    return max(1, rows // per_step) * max(1, cfg.train.epochs), True


__all__ = [ "PreflightError", "PreflightReport", "check_before_start", "fingerprint",
           "preflight"]
