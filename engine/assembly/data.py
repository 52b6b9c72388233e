"""A run's data: the tokenized datasets (a mixture of the training sources), the raw evaluation
rows, the data reports, this rank's loaders, and the loop's step and epoch counts.

Files are tokenized through the data cache (engine.data.cache): the first rank to need a file
encodes it while the others wait on the entry's lock, then they and every later run read it."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

from contract.config.checks import source_name
from contract.config.schema import RunConfig
from contract.data_files import load_rows
from engine.context import RunContext
from engine.data.cache import cached_dataset
from engine.data.inbox import InboxDataset
from engine.data.loader import build_dataloader
from engine.data.mixture import MixtureDataset, Source, source_seed
from engine.data.prompts import build_prompt_dataset, collate_prompts
from engine.generation.generate import pad_id
from engine.data.default_task import default_root, ensure_default_assets, sources_for


@dataclass
class RunData:
    """The run's data: tokenized datasets, the raw evaluation rows (for evaluators that generate
    and compare text), the data reports, and the collate functions given."""
    train: Any
    eval: Any
    eval_rows: list | None
    reports: dict
    train_collate_fn: Callable | None = None
    eval_collate_fn: Callable | None = None


def run_data(cfg: RunConfig, tokenizer, *, train_dataset=None, eval_dataset=None,
             train_collate_fn: Callable | None = None, eval_collate_fn: Callable | None = None) -> RunData:
    """Tokenized train / eval datasets and their reports; given datasets are used as they are."""
    reports: dict = {}
    train_src, eval_src = cfg.data.train, cfg.data.eval
    if cfg.uses_default_task:  # the objective's variant of the default task
        train_path, eval_path = sources_for(ensure_default_assets(default_root()), cfg.preference.objective)
        train_src, eval_src = str(train_path), eval_src or str(eval_path)
    if cfg.preference.objective == "grpo":  # prompt rows; answers are sampled (engine.data.prompts)
        return _prompt_data(cfg, tokenizer, train_src, train_dataset, train_collate_fn, reports)
    if train_dataset is None:
        train_dataset = training_sources(cfg, tokenizer, train_src, reports)
    if eval_dataset is None and eval_src:
        eval_dataset, reports["eval"] = cached_dataset(
            eval_src, tokenizer, format=cfg.data.format, max_length=cfg.data.max_length,
            overlong=cfg.data.overlong)
    eval_rows = load_rows(eval_src) if eval_src else None
    return RunData(train_dataset, eval_dataset, eval_rows, reports, train_collate_fn, eval_collate_fn)


def _prompt_data(cfg: RunConfig, tokenizer, train_src: str, train_dataset, train_collate_fn, reports: dict) -> RunData:
    """A GRPO run's data: its prompt rows, batched as left-padded prompts; no evaluation data yet."""
    if train_dataset is None:
        train_dataset, reports["train"] = build_prompt_dataset(train_src, tokenizer, cfg.data.max_length,
                                                               cfg.data.overlong)
    collate = train_collate_fn or functools.partial(collate_prompts, pad=pad_id(tokenizer))
    return RunData(train_dataset, None, None, reports, collate, None)


def training_sources(cfg: RunConfig, tokenizer, train_src: str, reports: dict) -> MixtureDataset:
    """The run's training sources (data.sources, or data.train as the one source "train") as a
    mixture (engine.data.mixture); each source's data report goes into `reports`."""
    specs = cfg.data.sources or [{"path": train_src, "format": cfg.data.format, "name": "train"}]
    sources = []
    for i, spec in enumerate(specs):
        name = source_name(spec, i)
        dataset, report = cached_dataset(
            spec["path"], tokenizer, format=spec.get("format", "auto"), max_length=cfg.data.max_length,
            overlong=cfg.data.overlong)
        reports["train" if not cfg.data.sources else f"train/{name}"] = report
        sources.append(Source(name, dataset, path=spec["path"], format=spec.get("format", "auto"),
                              weight=float(spec.get("weight", 1.0)),
                              seed=source_seed(cfg.train.seed, name, first=i == 0)))
    return MixtureDataset(sources, build=lambda spec: rebuild_source(cfg, tokenizer, spec))


def rebuild_source(cfg: RunConfig, tokenizer, spec: dict):
    """The dataset of a source added live, from a checkpoint's record of it (at resume)."""
    if spec["kind"] == "inbox":
        return InboxDataset(tokenizer, cfg.data.max_length, spec["path"])
    return cached_dataset(spec["path"], tokenizer, format=spec["format"],
                         max_length=cfg.data.max_length, overlong=cfg.data.overlong)[0]


def train_loader(ctx: RunContext, data: RunData, epoch: int, start_batch: int = 0):
    """The training batches of `epoch`, this rank's share, from micro-batch `start_batch` on."""
    cfg = ctx.config
    loader = build_dataloader(
        data.train, micro_batch_size=cfg.train.micro_batch_size, dp_rank=ctx.env.dp_rank,
        dp_size=ctx.env.dp_size, seed=cfg.train.seed, strategy=cfg.data.batching,
        tokenizer=ctx.tokenizer, max_length=cfg.data.max_length,
        num_workers=cfg.data.num_workers, shuffle=True, drop_last=True,
        collate_fn=data.train_collate_fn, block=cfg.train.grad_accum,
        repeat=cfg.grpo.num_iterations if cfg.preference.objective == "grpo" else 1)  # reused samples
    loader.batch_sampler.set_epoch(epoch)
    loader.batch_sampler.set_start_batch(start_batch)
    return loader


def eval_loader(ctx: RunContext, data: RunData):
    """The evaluation batches, this rank's share, in order."""
    cfg = ctx.config
    return build_dataloader(
        data.eval, micro_batch_size=cfg.eval.batch_size, dp_rank=ctx.env.dp_rank,
        dp_size=ctx.env.dp_size, seed=cfg.train.seed, strategy="random", tokenizer=ctx.tokenizer,
        max_length=cfg.data.max_length, num_workers=0, shuffle=False, drop_last=False,
        collate_fn=data.eval_collate_fn)


def micro_batches_per_epoch(ctx: RunContext, data: RunData) -> int:
    return train_loader(ctx, data, 0).batch_sampler.num_batches


def total_steps(cfg: RunConfig, micro_batches: int) -> int:
    """Optimizer steps of the run: train.max_steps, or every epoch's."""
    return cfg.train.max_steps or (micro_batches // cfg.train.grad_accum) * cfg.train.epochs


def epochs(cfg: RunConfig, micro_batches: int) -> int:
    """Epochs the loop runs: enough to reach train.max_steps, or train.epochs."""
    if cfg.train.max_steps:
        return math.ceil(cfg.train.max_steps / max(1, micro_batches // cfg.train.grad_accum))
    return cfg.train.epochs
