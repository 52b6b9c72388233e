"""How the ranks of a save agree: the few collectives publishing needs (engine.checkpoint.atomic).

A save fails alike on every rank or on none: each phase ends in an agreement over these
collectives, so no rank leaves a save while another still waits in one of its collectives.
Without a process group it is a single process and every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Comm:
    """The few collectives publishing needs; a single process when no process group exists."""
    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> "Comm":
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def agree(self, problem: str | None) -> list[str]:
        """Every rank's problem (None: none), so that all ranks raise the same error or none."""
        return [f"rank {r}: {p}" if self.world > 1 else p
                for r, p in enumerate(self.all_gather(problem)) if p]
