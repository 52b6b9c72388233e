"""`build_dataloader`: a dataset, a batching strategy and a rank -> a torch DataLoader."""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.data import DataLoader

from engine.data.collate import PaddingCollator
from engine.data.mixture import MixtureDataset
from engine.data.packing import PackedDataset
from engine.data.repeat_sampler import RepeatedBatchSampler
from engine.data.sampler import DistributedBatchSampler


def lengths_of(dataset, needed: bool) -> list[int] | int:
    """The samples' lengths (from `dataset.lengths`, else measured when `needed`), else their count."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is not None:
        return list(lengths)
    if needed:
        return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
    return len(dataset)


def build_dataloader(dataset, *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                     seed: int = 0, strategy: str = "random", tokenizer=None, max_length: int = 512,
                     num_workers: int = 0, shuffle: bool = True, drop_last: bool = True,
                     collate_fn: Callable | None = None, repeat: int = 1, block: int = 1) -> DataLoader:
    """A DataLoader over this rank's share of `dataset`.

    strategy "packing" packs samples into rows of up to `max_length` tokens first (a micro-batch
    is then `micro_batch_size` packed rows). Its `batch_sampler` is a
    :class:`DistributedBatchSampler`: call `loader.batch_sampler.set_epoch(e)` per epoch and
    `set_start_batch(k)` to resume. Training: shuffle=True, drop_last=True. Evaluation:
    shuffle=False, drop_last=False (every sample exactly once across the ranks). `collate_fn`
    replaces the right-padding collator built from `tokenizer`. A
    :class:`~engine.data.mixture.MixtureDataset` (the run's sources) is drawn by its mixture.
    `repeat` > 1: each `block` of micro-batches comes `repeat` times (a GRPO run reusing its
    samples, engine.data.repeat_sampler).
    """
    if isinstance(dataset, MixtureDataset) and shuffle and drop_last:
        # the run's sources (engine.data.mixture): drawn lazily, one step at a time, in this
        # process, so a change made at a step boundary applies from the next step on
        sampler = dataset.batch_sampler(micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                                        dp_size=dp_size, seed=seed, strategy=strategy,
                                        max_length=max_length)
        num_workers = 0
    else:
        dataset, sampler = _plain_sampler(dataset, micro_batch_size, dp_rank, dp_size, seed, strategy,
                                          max_length, shuffle, drop_last, repeat, block)
    collate = collate_fn if collate_fn is not None else PaddingCollator(tokenizer)
    # Its own generator: a DataLoader otherwise draws its workers' base seed from the global torch
    # RNG each time it is iterated, and a run resumed mid-epoch (one extra iteration) would then
    # see other dropout masks than the uninterrupted run.
    generator = torch.Generator().manual_seed(seed % 2**63)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                      generator=generator)


def _plain_sampler(dataset, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int, strategy: str,
                   max_length: int, shuffle: bool, drop_last: bool, repeat: int = 1, block: int = 1) -> tuple:
    """(what the loader reads, its sampler) for a dataset that is no mixture (a user's own,
    evaluation data): packed rows under "packing"."""
    if strategy == "packing":
        dataset = PackedDataset(dataset, max_length)
    kind, extra = (RepeatedBatchSampler, {"repeat": repeat, "block": block}) if repeat > 1 else (DistributedBatchSampler, {})
    sampler = kind(
        lengths_of(dataset, needed=strategy == "group_by_length"), micro_batch_size, dp_rank=dp_rank,
        dp_size=dp_size, seed=seed, strategy=strategy, drop_last=drop_last, shuffle=shuffle, **extra)
    return dataset, sampler
