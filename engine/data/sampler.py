"""The distributed batch sampler: which samples each data-parallel rank trains, batch by batch.

An epoch's order is a pure function of (seed, epoch, strategy, sizes): every rank computes the
same global batches (micro_batch_size x dp_size samples) and takes its share of each, so ranks
never overlap and always run the same number of batches (the collectives of a step need that).

* random: a fresh permutation per epoch.
* group_by_length: the permutation is cut into megabatches of 50 global batches, each sorted by
  length and cut into global batches, which are then shuffled (the one holding the longest sample
  first, so that running out of memory happens at once, not hours in). Like transformers'
  LengthGroupedSampler, but global: all ranks of a step get similar lengths.
* packing: random order over packed rows (the rows are made by `engine.data.packing`).

With drop_last the incomplete last global batch is left out. Without (evaluation), every sample
is used exactly once: the remainder forms a last, smaller batch (merged with the one before when
it has fewer samples than there are ranks).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from contract.data_rows import DataError

STRATEGIES = ("random", "group_by_length", "packing")
MEGABATCH = 50  # global batches per length-sorted megabatch


class DistributedBatchSampler(Sampler[list[int]]):
    """Batches of indices for one data-parallel rank; see the module docstring.

    `lengths` are the samples' token counts (an int: only the number of samples, for strategies
    that do not look at lengths). Call `set_epoch` before each epoch, then `set_start_batch(k)`
    to resume that epoch after its first k batches.
    """

    def __init__(self, lengths: Sequence[int] | int, batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, strategy: str = "random", drop_last: bool = True,
                 shuffle: bool = True):
        if strategy not in STRATEGIES:
            raise DataError(f"data.batching must be one of {STRATEGIES}, not {strategy!r}")
        if batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"need batch_size >= 1 and 0 <= dp_rank < dp_size, got batch_size="
                            f"{batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
        if isinstance(lengths, int) and strategy == "group_by_length":
            raise DataError("group_by_length needs the samples' lengths")
        self.lengths = None if isinstance(lengths, int) else np.asarray(lengths, dtype=np.int64)
        self.num_samples = lengths if isinstance(lengths, int) else len(lengths)
        self.batch_size, self.dp_rank, self.dp_size = batch_size, dp_rank, dp_size
        self.seed, self.strategy, self.drop_last, self.shuffle = seed, strategy, drop_last, shuffle
        self.global_size = batch_size * dp_size
        needed = self.global_size if drop_last else dp_size
        if self.num_samples < needed:
            raise DataError(f"{self.num_samples} samples are too few for {dp_size} ranks with "
                            f"micro_batch_size {batch_size} (need at least {needed})")
        self.epoch, self.start_batch, self.position = 0, 0, 0

    # -- the order ------------------------------------------------------------------------------
    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed % 2**63, epoch])

    def _order(self, rng: np.random.Generator) -> np.ndarray:
        n = self.num_samples
        if self.strategy != "group_by_length":
            return rng.permutation(n) if self.shuffle else np.arange(n)
        if not self.shuffle:  # one stable sort, longest first
            return np.argsort(-self.lengths, kind="stable")
        order = rng.permutation(n)
        mega = self.global_size * MEGABATCH
        parts = [order[i:i + mega] for i in range(0, n, mega)]
        return np.concatenate([p[np.argsort(-self.lengths[p], kind="stable")] for p in parts])

    def _chunks(self, order: np.ndarray) -> list[np.ndarray]:
        size, full = self.global_size, len(order) // self.global_size
        chunks = [order[i * size:(i + 1) * size] for i in range(full)]
        rest = order[full * size:]
        if self.drop_last or len(rest) == 0:
            return chunks
        if len(rest) >= self.dp_size:
            return chunks + [rest]
        merged = np.concatenate([chunks.pop(), rest])  # too few for every rank: share the last one
        halves = np.array_split(merged, 2)
        return chunks + (halves if len(halves[1]) >= self.dp_size else [merged])

    def global_batches(self, epoch: int) -> list[list[int]]:
        """Every rank's samples of each step of `epoch` (rank r takes [r::dp_size])."""
        rng = self._rng(epoch)
        chunks = self._chunks(self._order(rng))
        if self.shuffle and self.strategy == "group_by_length":
            chunks = [chunks[i] for i in rng.permutation(len(chunks))]
            longest = max(range(len(chunks)), key=lambda i: self.lengths[chunks[i]].max())
            chunks.insert(0, chunks.pop(longest))
        return [c.tolist() for c in chunks]

    def rank_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of `epoch`, from the first (ignoring the start batch)."""
        return [b[self.dp_rank::self.dp_size] for b in self.global_batches(epoch)]

    # -- iteration and resuming -----------------------------------------------------------------
    @property
    def num_batches(self) -> int:
        """Batches per rank in a whole epoch (the same on every rank)."""
        full, rest = divmod(self.num_samples, self.global_size)
        if self.drop_last or rest == 0:
            return full
        if rest >= self.dp_size:
            return full + 1
        return full + int((self.global_size + rest) // 2 >= self.dp_size)  # see _chunks

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run `epoch` from its first batch (then `set_start_batch`)."""
        self.epoch, self.start_batch, self.position = epoch, 0, 0

    def set_start_batch(self, batch: int) -> None:
        """Start the epoch after its first `batch` batches (those already trained)."""
        if not 0 <= batch <= self.num_batches:
            raise DataError(f"start batch {batch} is outside the epoch's 0..{self.num_batches} batches")
        self.start_batch = self.position = batch

    def __len__(self) -> int:
        return self.num_batches - self.start_batch

    def __iter__(self) -> Iterator[list[int]]:
        for index, batch in enumerate(self.rank_batches(self.epoch)[self.start_batch:], self.start_batch):
            # with worker processes the loader fetches ahead: position may run ahead of training
            self.position = index + 1
            yield batch

    def _fingerprint(self) -> dict:
        return {"seed": self.seed, "strategy": self.strategy, "batch_size": self.batch_size,
                "dp_size": self.dp_size, "num_samples": self.num_samples,
                "drop_last": self.drop_last, "shuffle": self.shuffle}

    def state_dict(self, batches_done: int | None = None) -> dict:
        """Where to go on from: the next (epoch, batch). `batches_done`, when given, counts the
        epoch's batches trained (safer than the iterator's position when workers prefetch)."""
        batch = self.position if batches_done is None else batches_done
        epoch = self.epoch
        if batch >= self.num_batches:
            epoch, batch = epoch + 1, 0
        return {"epoch": epoch, "batch": batch, **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state`; refuses a state of a different order (seed, sizes, strategy...)."""
        differ = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in self._fingerprint().items()
                  if state.get(k) != v]
        if differ:
            raise DataError("cannot resume the data order exactly, the sampler differs: " + "; ".join(differ))
        self.set_epoch(int(state["epoch"]))
        self.set_start_batch(int(state["batch"]))
