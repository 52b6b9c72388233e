"""Monitors measure each training step; sinks write the records (events.jsonl, TensorBoard).

A monitor returns a few named numbers for the step's record; the trainer merges them into one
`{"type": "train", ...}` event, written on rank 0 only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from contract.run_folder import EventLog


@dataclass
class StepInfo:
    """What one optimizer step produced, already averaged / summed over the data-parallel group."""
    step: int
    epoch: int
    loss: float
    tokens: int          # real (non-pad) tokens trained in this step, all ranks
    step_time: float     # seconds
    lr: float | None = None  # the rate this step trained with, read before its update


class Monitor:
    def measure(self, trainer, info: StepInfo) -> dict[str, float]:
        raise NotImplementedError


class LossMonitor(Monitor):
    def measure(self, trainer, info):
        return {"loss": info.loss}


class LRMonitor(Monitor):
    """The learning rate the step was trained with (not the next step's: the scheduler has
    already advanced when the monitors run)."""

    def measure(self, trainer, info):
        return {"lr": info.lr if info.lr is not None else trainer.current_lr()}


class StepTimeMonitor(Monitor):
    def measure(self, trainer, info):
        return {"step_time": info.step_time}


class TokensPerSecondMonitor(Monitor):
    """Real tokens (padding excluded) per second, over the whole data-parallel group."""

    def measure(self, trainer, info):
        return {"tokens": info.tokens, "tokens_per_s": info.tokens / max(info.step_time, 1e-9)}


class MemoryMonitor(Monitor):
    """CUDA peak allocated memory where there is a GPU, otherwise this process's RSS (MiB)."""

    def measure(self, trainer, info):
        if torch.cuda.is_available():
            return {"mem_mb": torch.cuda.max_memory_allocated() / 2**20}
        return {"mem_mb": psutil.Process(os.getpid()).memory_info().rss / 2**20}


DEFAULT_MONITORS = (LossMonitor, LRMonitor, StepTimeMonitor, TokensPerSecondMonitor, MemoryMonitor)


class TensorBoardSink:
    """Scalars of every train / eval record, under `train/...` and `eval/...`."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter  # imported late: tensorboard is slow to load
        self.writer = SummaryWriter(str(folder))

    def __call__(self, event: dict) -> None:
        kind = event.get("type")
        if kind not in ("train", "eval"):
            return
        for key, value in event.items():
            if key in ("type", "step", "epoch", "time") or not isinstance(value, (int, float)):
                continue
            name = key if "/" in key else f"{kind}/{key}"
            self.writer.add_scalar(name, value, event.get("step", 0))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_sinks(events_path: Path, tensorboard_dir: Path | None) -> tuple[EventLog, TensorBoardSink | None]:
    log = EventLog(events_path)
    tb = TensorBoardSink(tensorboard_dir) if tensorboard_dir else None
    if tb:
        log.subscribe(tb)
    return log, tb
