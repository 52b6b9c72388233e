"""The batch sampler of a GRPO run that reuses its samples (`grpo.num_iterations` > 1): each
optimizer step's micro-batches come `repeat` times in a row, as TRL's RepeatSampler deals them
(docs/rewards.md). Every optimizer step is a step; the step strategy samples answers on the first
of each run of repeats and trains the buffered samples on the others, so an epoch visits each
prompt once in `repeat` times as many steps, and a resume anywhere in between finds its place."""

from __future__ import annotations

from engine.data.sampler import DistributedBatchSampler


class RepeatedBatchSampler(DistributedBatchSampler):
    """A DistributedBatchSampler whose epoch is each block of `block` global batches (one
    optimizer step's micro-batches) `repeat` times in a row; an incomplete last block is left
    out (the loop drops an incomplete step anyway)."""

    def __init__(self, *args, block: int = 1, repeat: int = 1, **kwargs):
        self.block, self.repeat = max(1, block), max(1, repeat)
        super().__init__(*args, **kwargs)

    def global_batches(self, epoch: int) -> list[list[int]]:
        once = super().global_batches(epoch)
        blocks = [once[i:i + self.block] for i in range(0, len(once) - self.block + 1, self.block)]
        return [batch for b in blocks for _ in range(self.repeat) for batch in b]

    @property
    def num_batches(self) -> int:
        return (super().num_batches // self.block) * self.block * self.repeat

    def _fingerprint(self) -> dict:
        return {**super()._fingerprint(), "block": self.block, "repeat": self.repeat}
