"""Packing: several samples per row, each attending only to itself.

A packed row concatenates samples; `position_ids` restart at 0 at each sample. Given
`attention_mask=None` and no cache, transformers (masking_utils.find_packed_sequence_indices)
starts a new sequence wherever consecutive positions do not increase by one, and builds a
block-diagonal causal mask from that, for sdpa and eager alike. The first label of every sample
is -100, so the loss never asks a sample's last token to predict the next sample's first.

The model must run without a KV cache in training (`use_cache=False`, in its config or the
call): with a cache, transformers skips the packed-sequence detection and the samples would
see each other.
"""

from __future__ import annotations

import bisect

from torch.utils.data import Dataset

from contract.data_rows import IGNORE
from contract.data_rows import DataError


def pack_lengths(lengths: list[int], max_length: int) -> list[list[int]]:
    """Bins of sample indices, each summing to at most `max_length` tokens: best-fit decreasing
    (longest sample first, into the fullest bin it fits). Deterministic; bins in creation order."""
    too_long = [i for i, n in enumerate(lengths) if n > max_length]
    if too_long:
        raise DataError(f"packing: samples {too_long[:10]} are longer than max_length={max_length}")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (space left, bin index)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[index]
        at = bisect.bisect_left(free, (need, -1))
        if at == len(free):
            bins.append([index])
            bisect.insort(free, (max_length - need, len(bins) - 1))
            continue
        space, which = free.pop(at)
        bins[which].append(index)
        bisect.insort(free, (space - need, which))
    return bins


class PackedDataset(Dataset):
    """Rows of packed samples: {"input_ids", "labels", "position_ids"}; `lengths` per row."""

    def __init__(self, dataset, max_length: int, lengths: list[int] | None = None):
        lengths = lengths if lengths is not None else getattr(dataset, "lengths", None)
        if lengths is None:
            lengths = [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
        self.dataset, self.max_length = dataset, max_length
        self.bins = pack_lengths(list(lengths), max_length)
        self.lengths = [sum(lengths[i] for i in b) for b in self.bins]

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict:
        ids, labels, positions = [], [], []
        for sample_index in self.bins[index]:
            sample = self.dataset[sample_index]
            n = len(sample["input_ids"])
            ids += sample["input_ids"]
            labels += [IGNORE] + list(sample.get("labels", sample["input_ids"]))[1:]
            positions += range(n)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    @property
    def fill(self) -> float:
        """Share of the rows' max_length slots holding real tokens."""
        return sum(self.lengths) / (len(self.bins) * self.max_length) if self.bins else 0.0
