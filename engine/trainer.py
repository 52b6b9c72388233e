"""The Trainer: a CoLLie-style training loop on a real DeepSpeed engine.

Read `train()` top to bottom: epochs, optimizer steps of `grad_accum` micro-batches, a record per
step, evaluation and checkpoints on their schedules, and the callbacks (the control plane is one)
at every step boundary. Set-up (model, data, DeepSpeed) lives in `engine.setup`.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from engine import setup
from engine.callbacks import Callback, CallbackList
from contract.config import RunConfig
from engine.monitors import DEFAULT_MONITORS, Monitor, StepInfo
from engine.rng import preserved_rng
from engine.steps import choose_strategy


@dataclass
class TrainerState:
    """Where the trainer is; saved in checkpoints so that a resumed run skips exactly what it did."""
    epoch: int = 0
    batch_in_epoch: int = 0   # micro-batches of the current epoch already trained
    global_step: int = 0      # optimizer steps done
    total_steps: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class Trainer:
    """Train a causal LM with DeepSpeed; every argument but `config` is optional.

    The roles are CoLLie's: pass your own `model`, `tokenizer`, datasets, `loss_fn(batch, outputs)`
    (arguments matched by name to the batch's and the model outputs' fields), `train_fn(trainer,
    micro_batches) -> (loss, tokens)`, `eval_fn`, `optimizer`, `lr_scheduler`, `callbacks`,
    `monitors` and `evaluators`; whatever you leave out is built from the config.
    """

    def __init__(self, model: torch.nn.Module | None = None, config: RunConfig | None = None,
                 tokenizer=None, loss_fn: Callable | None = None, train_fn: Callable | None = None,
                 eval_fn: Callable | None = None, optimizer=None, lr_scheduler=None,
                 train_dataset=None, eval_dataset=None, callbacks: Iterable[Callback] = (),
                 train_dataset_collate_fn: Callable | None = None,
                 eval_dataset_collate_fn: Callable | None = None,
                 monitors: Iterable[Monitor] | None = None, evaluators: Iterable | None = None,
                 run_dir: str | None = None, server: bool = False):
        self.config = config or RunConfig()
        self.callbacks = CallbackList(list(callbacks))
        self.loss_fn, self.eval_fn = loss_fn, eval_fn
        self.train_fn = train_fn or choose_strategy(self.config)
        self.monitors = list(monitors) if monitors is not None else [m() for m in DEFAULT_MONITORS]
        self.state = TrainerState()
        self.should_stop = False
        self.paused = False

        self.env = setup.init_distributed(self.config)
        self.folder, self.events = setup.open_run_folder(self.config, run_dir, self.env.rank == 0)
        self.precision = setup.precision_of(self.config)
        self.tokenizer = tokenizer or setup.tokenizer_of(self.config)
        # eval_rows: the raw evaluation rows, for evaluators that generate and compare text
        self.train_dataset, self.eval_dataset, self.eval_rows, self.data_reports = setup.datasets_of(
            self.config, self.tokenizer, train_dataset, eval_dataset)
        self.train_collate_fn = train_dataset_collate_fn
        self.eval_collate_fn = eval_dataset_collate_fn
        self.state.total_steps = self._total_steps()
        self.engine, self.optimizer, self.lr_scheduler, self.ds_setup = setup.engine_of(
            self, model, optimizer, lr_scheduler)
        self.callbacks.fire("on_setup_parallel_model", self)
        self.evaluators = list(evaluators) if evaluators is not None else setup.evaluators_of(self.config)
        if server:
            setup.attach_server(self)
        self._announce()
        self.callbacks.fire("on_after_trainer_initialized", self)

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> None:
        cfg, state = self.config, self.state
        self.callbacks.fire("on_train_begin", self)
        self.emit({"type": "state", "state": "running", "step": state.global_step})
        accum = cfg.train.grad_accum
        for epoch in range(state.epoch, self._epochs()):
            state.epoch = epoch
            loader = self.train_loader(epoch, start_batch=state.batch_in_epoch)
            self.callbacks.fire("on_train_epoch_begin", self)
            for micro_batches in _chunks(loader, accum):
                if self._done():
                    break
                self.callbacks.fire("on_train_batch_begin", self, micro_batches)
                started = time.perf_counter()
                self.engine.train()
                loss, tokens = self.train_fn(self, micro_batches)
                state.global_step += 1
                state.batch_in_epoch += len(micro_batches)
                loss, tokens = self._reduce(loss, tokens)
                self._record(StepInfo(state.global_step, epoch, loss, tokens, time.perf_counter() - started))
                self.callbacks.fire("on_train_batch_end", self, loss)
                if _due(state.global_step, cfg.eval.every_n_steps):
                    self.evaluate()
            if self._done():
                break
            state.batch_in_epoch = 0
            state.epoch = epoch + 1
            if _due(epoch + 1, cfg.eval.every_n_epochs):
                self.evaluate()
            self.callbacks.fire("on_train_epoch_end", self)
        if cfg.eval.at_end and self.eval_dataset is not None and not self._evaluated_at(state.global_step):
            self.evaluate()
        self.callbacks.fire("on_train_end", self)

    def _done(self) -> bool:
        return self.should_stop or self.state.global_step >= self.state.total_steps

    # -- one step's pieces --------------------------------------------------------------------
    def compute_loss(self, batch: dict, model: Callable | None = None) -> torch.Tensor:
        """Forward one micro-batch and return its loss (the model's own, or `loss_fn`'s).

        `model` replaces the engine's forward: the fused LOMO step calls the bare module, whose
        backward DeepSpeed does not tie to `engine.backward`.
        """
        # No KV cache in training: it is wasted work, and with one transformers treats a packed
        # row as one sequence (samples would attend to each other).
        forward = model if model is not None else self.engine
        if self.env.pp_size > 1:  # the stages hold different layers (evaluation only)
            from engine.parallel.pipeline import eval_loss
            return eval_loss(self, batch)
        batch = {k: v.to(self.engine.device) for k, v in batch.items()}
        if self.loss_fn is None:
            return forward(**batch, use_cache=False).loss
        model_inputs = {k: v for k, v in batch.items() if k != "labels"}
        outputs = forward(**model_inputs, use_cache=False)
        return call_by_names(self.loss_fn, batch, outputs)

    def _reduce(self, loss: torch.Tensor, tokens: int) -> tuple[float, int]:
        """Mean loss and total real tokens over the data-parallel group (one small all-reduce)."""
        packed = torch.tensor([float(loss), float(tokens)], dtype=torch.float64)
        if self.env.world_size > 1:
            dist.all_reduce(packed, group=self.env.dp_group)
            packed[0] /= self.env.dp_size
        return float(packed[0]), int(packed[1])

    def _record(self, info: StepInfo) -> None:
        if not _due(info.step, self.config.logging.log_every_n_steps) and info.step != self.state.total_steps:
            return
        record: dict[str, Any] = {"type": "train", "step": info.step, "epoch": info.epoch,
                                  "total_steps": self.state.total_steps}
        for monitor in self.monitors:
            record.update(monitor.measure(self, info))
        self.emit(record)

    def current_lr(self) -> float:
        # self.optimizer: the engine's (wrapped) optimizer, or LOMO's fused one, which the
        # engine does not know about
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0

    def set_lr(self, lr: float) -> None:
        """Make the next step's learning rate `lr`; the schedule goes on from there, scaled."""
        current = self.current_lr()
        self.scale_lr(lr / current if current > 0 else 0.0, absolute=lr if current <= 0 else None)

    def scale_lr(self, factor: float, absolute: float | None = None) -> None:
        sched = self.lr_scheduler
        if sched is not None and hasattr(sched, "base_lrs"):
            if absolute is not None:  # at a zero point of the schedule: restart it from `absolute`
                sched.base_lrs = [absolute for _ in sched.base_lrs]
            else:
                sched.base_lrs = [b * factor for b in sched.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] = absolute if absolute is not None else group["lr"] * factor

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Run every evaluator (collective); training state, mode and RNG are left as they were."""
        if self.eval_dataset is None:
            return {}
        self.callbacks.fire("on_evaluate_begin", self)
        results: dict[str, float] = {}
        with preserved_rng(), torch.no_grad():
            self.engine.eval()
            try:
                if self.eval_fn is not None:
                    results.update(self.eval_fn(self))
                for evaluator in self.evaluators:
                    results.update(evaluator(self))
            finally:
                self.engine.train()
        self._last_eval_step = self.state.global_step
        self.emit({"type": "eval", "step": self.state.global_step, "epoch": self.state.epoch,
                   **{f"eval/{k}": v for k, v in results.items()}})
        self.callbacks.fire("on_evaluate_end", self, results)
        return results

    def _evaluated_at(self, step: int) -> bool:
        return getattr(self, "_last_eval_step", -1) == step

    # -- saving and loading (engine.checkpoint) ----------------------------------------------
    def save_model(self, path: str) -> None:
        """The model in Hugging Face format (plus tokenizer and config); only rank 0 writes."""
        from engine import checkpoint
        checkpoint.save_model(self, path)
        self.callbacks.fire("on_save_model", self, path)

    def load_model(self, path: str) -> None:
        from engine import checkpoint
        checkpoint.load_model(self, path)
        self.callbacks.fire("on_load_model", self, path)

    def save_peft(self, path: str, selected_adapters: list[str] | None = None) -> None:
        from engine import checkpoint
        checkpoint.save_peft(self, path, selected_adapters)

    def load_peft(self, path: str, adapter_name: str = "default", is_trainable: bool = True) -> None:
        from engine import checkpoint
        checkpoint.load_peft(self, path, adapter_name, is_trainable)

    def save_checkpoint(self, path: str) -> None:
        """Everything needed to continue bit for bit (model, optimizer, scheduler, position, RNG)."""
        from engine import checkpoint
        checkpoint.save_checkpoint(self, path)

    def load_checkpoint(self, path: str) -> None:
        from engine import checkpoint
        checkpoint.load_checkpoint(self, path)

    # -- data -----------------------------------------------------------------------------------
    def train_loader(self, epoch: int, start_batch: int = 0):
        return setup.train_loader_of(self, epoch, start_batch)

    def eval_loader(self):
        return setup.eval_loader_of(self)

    def _epochs(self) -> int:
        if self.config.train.max_steps:  # enough epochs to reach max_steps
            return math.ceil(self.config.train.max_steps / max(1, self._steps_per_epoch()))
        return self.config.train.epochs

    def _steps_per_epoch(self) -> int:
        return setup.micro_batches_per_epoch(self) // self.config.train.grad_accum

    def _total_steps(self) -> int:
        return self.config.train.max_steps or self._steps_per_epoch() * self.config.train.epochs

    # -- events ---------------------------------------------------------------------------------
    def emit(self, event: dict) -> None:
        """Write an event to events.jsonl (rank 0 only; other ranks' events are dropped)."""
        if self.events is not None:
            self.events.emit(event)

    def _announce(self) -> None:
        total, trainable = setup.parameter_counts(self)
        self.emit({"type": "setup", "world_size": self.env.world_size, "dp_size": self.env.dp_size,
                   "precision": self.precision, "total_steps": self.state.total_steps,
                   "parameters": total, "trainable_parameters": trainable,
                   "train_samples": len(self.train_dataset),
                   "eval_samples": len(self.eval_dataset) if self.eval_dataset is not None else 0,
                   "data": {k: r.summary() for k, r in self.data_reports.items()},
                   "warnings": self.ds_setup.warnings})

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None


def call_by_names(fn: Callable, batch: dict, outputs: Any) -> torch.Tensor:
    """Call `fn` with the batch's and the model outputs' fields its parameters name."""
    available = dict(batch)
    available.update({k: v for k, v in dict(outputs).items() if v is not None})
    available["batch"], available["outputs"] = batch, outputs
    params = inspect.signature(fn).parameters
    missing = [p for p in params if p not in available and params[p].default is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"loss_fn wants {missing}, which neither the batch ({sorted(batch)}) "
                        f"nor the model outputs ({sorted(dict(outputs))}) provide")
    return fn(**{p: available[p] for p in params if p in available})


def _chunks(iterable, size: int):
    chunk = []
    for item in iterable:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []


def _due(count: int, every: int) -> bool:
    return every > 0 and count > 0 and count % every == 0
