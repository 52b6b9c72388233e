"""The step-boundary exchange: rank 0 hands its queued commands to every rank.

One small collective per boundary when idle: the payload length as one int64, broadcast from
rank 0. Only when it is above zero does a second broadcast follow, the commands as JSON bytes in
a uint8 tensor (each command in its contract.protocol wire form). Every rank then holds the same
list of typed commands in the same order and executes it.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import torch
import torch.distributed as dist

from engine.control.pending import CommandQueue, Pending


class Boundary:
    """`exchange()` is collective: every rank calls it at the same points of the loop."""

    def __init__(self, rank: int, world_size: int, device: torch.device, commands: CommandQueue | None):
        if rank == 0 and commands is None:
            raise ValueError("rank 0 needs the command queue")
        self.rank, self.world_size, self.commands = rank, world_size, commands
        # gloo broadcasts CPU tensors, nccl only device tensors
        self.device = device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
        self._size = torch.zeros(1, dtype=torch.int64, device=self.device)
        # rank 0: which queued commands wait for a later boundary (the serving budget)
        self.hold: Callable[[Pending], bool] | None = None
        self.collectives = 0  # broadcasts issued, for tests and the benchmark
        # what an exchange costs a step when there is nothing to do (status, bench_control.py)
        self.idle_exchanges, self.idle_seconds = 0, 0.0

    def exchange(self, wait_s: float = 0.0) -> list[Pending]:
        """The commands to execute now, identical on every rank. On rank 0 `wait_s` > 0 first
        waits up to that long for a command (the paused loop's heartbeat)."""
        started = time.perf_counter()
        items: list[Pending] = []
        if self.commands is not None:  # rank 0
            if wait_s > 0:
                self.commands.wait(wait_s)
            items = self.commands.drain(self.hold)
        if self.world_size == 1:
            return items
        payload = json.dumps([p.wire() for p in items]).encode() if items else b""
        self._size.fill_(len(payload))
        dist.broadcast(self._size, src=0)
        self.collectives += 1
        size = int(self._size.item())
        if size == 0:
            if wait_s <= 0:
                self.idle_exchanges += 1
                self.idle_seconds += time.perf_counter() - started
            return items
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src=0)
        self.collectives += 1
        if self.rank == 0:
            return items
        wire = json.loads(bytes(buf.cpu().numpy().tobytes()))
        return [Pending.from_wire(d) for d in wire]
