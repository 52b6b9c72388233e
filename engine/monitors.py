"""Monitors measure each training step; sinks write the records (events.jsonl, TensorBoard,
CSV, Weights & Biases).

A monitor returns a few named numbers for the step's record; the trainer merges them into one
`{"type": "train", ...}` event, written on rank 0 only.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from contract.protocol.states import RunState
from contract.run_folder import EventLog
from contract.events import EventType

FINAL_STATES = tuple(s.value for s in RunState if s.final)


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
    """Rank 0's memory in MiB. On a GPU (torch.cuda, this rank's device): `mem_mb` and
    `mem_peak_mb` the peak of allocated tensor memory, `mem_allocated_mb` what is allocated now,
    `mem_reserved_mb` the peak the caching allocator has reserved (about what nvidia-smi shows
    beyond the CUDA context). On CPU: `mem_mb` this process's resident set size now,
    `mem_peak_mb` its peak (the kernel's high-water mark)."""

    def measure(self, trainer, info):
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated() / 2**20
            return {"mem_mb": peak, "mem_peak_mb": peak,
                    "mem_allocated_mb": torch.cuda.memory_allocated() / 2**20,
                    "mem_reserved_mb": torch.cuda.max_memory_reserved() / 2**20}
        rss = psutil.Process(os.getpid()).memory_info().rss / 2**20
        return {"mem_mb": rss, "mem_peak_mb": max(rss, peak_rss_mb())}


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM: reset by writing 5 to /proc/self/clear_refs,
    which a benchmark does between two runs in one process); ru_maxrss where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class SourcesMonitor(Monitor):
    """Samples drawn per training source (all ranks) since the last record: `samples_per_source`
    (engine.data.mixture; nothing for a dataset that is no mixture)."""

    def measure(self, trainer, info):
        mixture = getattr(trainer.train_dataset, "mixture", None)
        return {"samples_per_source": mixture.take_counts()} if mixture is not None else {}


class StepMetricsMonitor(Monitor):
    """The step strategy's own numbers for the step, where it keeps some in `metrics` (a
    preference objective's rewards and log-probabilities: engine.objectives.preference_step)."""

    def measure(self, trainer, info):
        return dict(getattr(trainer.train_fn, "metrics", None) or {})


DEFAULT_MONITORS = (LossMonitor, LRMonitor, StepTimeMonitor, TokensPerSecondMonitor, MemoryMonitor,
                    SourcesMonitor, StepMetricsMonitor)


class TensorBoardSink:
    """Scalars of every train / eval record, under `train/...` and `eval/...`."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter  # imported late: tensorboard is slow to load
        self.writer = SummaryWriter(str(folder))

    def __call__(self, event: dict) -> None:
        kind = event.get("type")
        if kind not in (EventType.TRAIN, EventType.EVAL):
            return
        for key, value in event.items():
            if key in ("type", "step", "epoch", "time") or not isinstance(value, (int, float)):
                continue
            name = key if "/" in key else f"{kind}/{key}"
            self.writer.add_scalar(name, value, event.get("step", 0))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _scalars(event: dict) -> dict[str, float]:
    """The numbers of a train / eval record, named `train/...` and `eval/...` (TensorBoard's and
    W&B's convention)."""
    kind = event.get("type")
    return {(key if "/" in key else f"{kind}/{key}"): value for key, value in event.items()
            if key not in ("type", "step", "epoch", "time") and isinstance(value, (int, float))
            and not isinstance(value, bool)}


class CsvSink:
    """`train.csv` and `eval.csv` in the run folder: one row per record, one column per number
    (step and epoch first). A number that appears only later (a custom monitor's) widens the
    file: it is rewritten once with the new column, the rows before it left blank there."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.columns: dict[str, list[str]] = {}

    def __call__(self, event: dict) -> None:
        kind = event.get("type")
        if kind not in (EventType.TRAIN, EventType.EVAL):
            return
        row = {"step": event.get("step", 0), "epoch": event.get("epoch", ""), "time": event.get("time", ""),
               **{k: v for k, v in event.items() if k not in ("type", "step", "epoch", "time")
                  and isinstance(v, (int, float)) and not isinstance(v, bool)}}
        path = self.folder / f"{kind}.csv"
        columns = self.columns.get(kind)
        if columns is None or any(k not in columns for k in row):
            old = list(csv.DictReader(path.open())) if columns is not None and path.exists() else []
            columns = [*(columns or []), *(k for k in row if k not in (columns or []))]
            self.columns[kind] = columns
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows(old)
        with path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=columns).writerow(row)


class WandbSink:
    """Weights & Biases: `offline` writes the run under `<run folder>/wandb/` with no network
    (`wandb sync` uploads it later); `online` logs as it goes (needs `wandb login`). The W&B run
    ends when the run's final state is recorded."""

    def __init__(self, folder: Path, mode: str, project: str, config: dict):
        import wandb  # imported late: only runs that ask for W&B need it installed
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False,
                                  disable_git=True)
        self.run = wandb.init(project=project or "livetune", name=folder.name, dir=str(folder), mode=mode,
                              config=config, settings=settings, reinit="create_new")
        # the x axis is the run's optimizer step, logged as a value: after a rewind the step goes
        # back, which W&B's own (monotonic) step would drop
        self.run.define_metric("global_step")
        self.run.define_metric("*", step_metric="global_step")

    def __call__(self, event: dict) -> None:
        kind = event.get("type")
        if kind in (EventType.TRAIN, EventType.EVAL):
            self.run.log({"global_step": int(event.get("step", 0)), **_scalars(event)})
        elif kind == EventType.STATE and event.get("state") in FINAL_STATES:
            self.close()

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()


def open_sinks(events_path: Path, cfg) -> EventLog:
    """Rank 0's event log, with the sinks the config asks for subscribed to it: TensorBoard
    (`logging.tensorboard`), CSV files (`logging.csv`), Weights & Biases (`logging.wandb`)."""
    log = EventLog(events_path)
    folder = events_path.parent
    if cfg.logging.tensorboard:
        log.subscribe(TensorBoardSink(folder / "tensorboard"))
    if cfg.logging.csv:
        log.subscribe(CsvSink(folder))
    if cfg.logging.wandb != "off":
        log.subscribe(WandbSink(folder, cfg.logging.wandb, cfg.logging.wandb_project, cfg.to_dict()))
    return log
