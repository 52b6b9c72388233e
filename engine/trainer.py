"""The Trainer: a CoLLie-style training loop on a real DeepSpeed engine.

Read `train()` top to bottom: epochs of optimizer steps, and in `_train_step` one step's phases
in their fixed order -- data, forward and loss, backward, optimizer step (the step strategy,
engine.steps), record, evaluate if due, checkpoint if due, control boundary. The loop owns its
control flow, as the Hugging Face Trainer does with its TrainerControl: callbacks (early
stopping, the spike guard) and the control plane's commands that move the loop (pause, stop,
rewind, branch: engine.control.moves) answer with a Signal (engine.callbacks), and `_act` is the
one place that carries it out -- then the command is answered. Only a skip is carried out inside
the step (by the step strategy, before the backward); whatever else a hook asks there reaches
`_act` with the step's other signals. Callbacks are for user extensions; the checkpoint schedule,
the control plane, the live settings, `resume` and the final save are parts of the loop, built
by the composition root (`engine.assembly`) from the config and declared here, so a Trainer
made in a script is the same run as a launched one.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from contract.config.schema import RunConfig
from contract.protocol.states import RunState
from contract.events import EvalEvent, Event, StateEvent, TrainEvent, WarningEvent
from engine import checkpoint
from engine.control import chat_only
from engine.assembly import data as run_data
from engine.assembly.loop import announce_run, control_of, start
from engine.assembly.root import Given, assemble
from engine.callbacks import NOTHING, Callback, Signal
from engine.checkpoint import rewind as rewinding
from engine.checkpoint import state as checkpoint_state
from engine.checkpoint.locations import CheckpointError
from engine.control.plane import Control
from engine.control.settings import LiveSettings
from engine.objectives.losses import PER_MICRO_BATCH, Window
from engine.steps import asked_by
from engine.monitors import Monitor, StepInfo
from engine.rng import preserved_rng

__all__ = ["Trainer",]


def _from_context(name: str, doc: str) -> property:
    """An attribute of the Trainer that is its run context's field (one value, two names)."""
    def get(self: "Trainer") -> Any:
        return getattr(self.ctx, name)

    def put(self: "Trainer", value: Any) -> None:
        setattr(self.ctx, name, value)

    return property(get, put, doc=doc)


class Trainer:
    """Train a causal LM with DeepSpeed; every argument but `config` is optional.

    The roles are CoLLie's: pass your own `model`, `tokenizer`, datasets, `loss_fn(batch, outputs)`
    (arguments matched by name to the batch's and the model outputs' fields, plus
    `num_items_in_batch`, the step's label tokens, as the HF Trainer passes it), `train_fn(trainer,
    micro_batches) -> (loss, tokens)`, `eval_fn`, `optimizer`, `lr_scheduler`, `callbacks`,
    `monitors` and `evaluators`; whatever you leave out is built from the config. The constructor
    hands them to the composition root (engine.assembly.root.assemble), stores the parts it
    gets back, and lets engine.assembly.loop.start connect them.
    """

    env = _from_context("env", "This rank's place in the process group and layout.")
    layout = _from_context("layout", "The parallel layout object (engine.parallel.layouts).")
    method = _from_context("method", "The fine-tuning method object (engine.model.methods).")
    precision = _from_context("precision", "The resolved training precision.")
    tokenizer = _from_context("tokenizer", "The run's tokenizer.")
    folder = _from_context("folder", "The run folder.")
    events = _from_context("events", "The event log (rank 0; None elsewhere).")
    state = _from_context("state", "Where the loop is (TrainerState).")
    engine = _from_context("engine", "The DeepSpeed engine.")
    optimizer = _from_context("optimizer", "The optimizer (the engine's, or the method's own).")
    lr_scheduler = _from_context("lr_scheduler", "The learning-rate schedule.")

    def __init__(self, model: torch.nn.Module | None = None, config: RunConfig | None = None,
                 tokenizer=None, loss_fn: Callable | None = None, train_fn: Callable | None = None,
                 eval_fn: Callable | None = None, optimizer=None, lr_scheduler=None,
                 train_dataset=None, eval_dataset=None, callbacks: Iterable[Callback] = (),
                 train_dataset_collate_fn: Callable | None = None,
                 eval_dataset_collate_fn: Callable | None = None,
                 monitors: Iterable[Monitor] | None = None, evaluators: Iterable | None = None,
                 run_dir: str | None = None, server: bool = False):
        parts = assemble(config or RunConfig(), Given(
            model=model, tokenizer=tokenizer, loss_fn=loss_fn, train_fn=train_fn, eval_fn=eval_fn,
            optimizer=optimizer, lr_scheduler=lr_scheduler, train_dataset=train_dataset,
            eval_dataset=eval_dataset, train_collate_fn=train_dataset_collate_fn,
            eval_collate_fn=eval_dataset_collate_fn, callbacks=tuple(callbacks), monitors=monitors,
            evaluators=evaluators, run_dir=run_dir))
        # the parts, as built (engine.assembly.root)
        self.config, self.ctx, self.data, self.ds_setup = parts.config, parts.ctx, parts.data, parts.ds_setup
        self.train_fn, self.loss_fn, self.eval_fn = parts.train_fn, parts.loss_fn, parts.eval_fn
        self.callbacks, self.monitors, self.evaluators = parts.callbacks, parts.monitors, parts.evaluators
        self.checkpoints, self.snapshots = parts.checkpoints, parts.snapshots  # snapshots: in host memory
        # the loop's own bookkeeping
        self._stopping = False  # a stop signal came: training ends after this step's boundary
        self._sampler = None
        self._last_eval_step = -1
        announce_run(self)  # set-up hooks, setup event
        # the control plane when the config enables it (commands at every step boundary)
        self.control: Control | None = control_of(self, chat_page=server)
        start(self)  # initialized hooks, resume

    @property
    def live_settings(self) -> LiveSettings:
        """What `set` (and `stop`) changed while the run goes on: the loop's schedule and final save."""
        return self.ctx.settings

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> None:
        """Train to the end (or a stop), then save the final model when the config says so."""
        cfg, state = self.config, self.state
        if cfg.control.chat_only and self.control is not None:  # hold the model for chat, train nothing
            self._act(chat_only.hold(self))
            self._boundary()  # holds: chat, evaluate, status ... until a stop
            self._last_boundaries()
            self.emit(StateEvent(state=RunState.FINISHED, step=state.global_step, chat_only=True))
            return
        self._act(self.callbacks.fire("on_train_begin", self))
        self._boundary()  # a pause sent before the first step holds it back
        self.emit(StateEvent(state=RunState.RUNNING, step=state.global_step))
        while state.epoch < self._epochs() and not self._done():
            epoch = state.epoch
            loader = self.train_loader(epoch, start_batch=state.batch_in_epoch)
            if self._act(self.callbacks.fire("on_train_epoch_begin", self)):
                continue  # rewound: the epoch starts again at the restored position
            for micro_batches in _chunks(loader, cfg.train.grad_accum):
                if self._train_step(epoch, micro_batches) or self._done():
                    break  # rewound (the epoch starts again there), or stopping
            else:  # the epoch ran to its end
                self._end_epoch(epoch)
        self._end_training()

    def _train_step(self, epoch: int, micro_batches: list[dict]) -> bool:
        """One optimizer step, its phases in order; True when a rewind moved the data position
        (the step's later phases are abandoned, and the loop starts its epoch again there)."""
        cfg, state = self.config, self.state
        if self._act(self.callbacks.fire("on_train_batch_begin", self, micro_batches)):
            return True
        started, lr = time.perf_counter(), self.current_lr()  # the step's own rate (the schedule moves)
        self.engine.train()
        loss, tokens = self._reduce(*self.train_fn(self, micro_batches))  # data, forward, loss, backward, update
        state.global_step += 1
        state.batch_in_epoch += len(micro_batches)
        self._record(StepInfo(state.global_step, epoch, loss, tokens, time.perf_counter() - started, lr))
        # the guard: rewind, pause (and what on_before_backward asked besides a skip)
        if self._act(asked_by(self.train_fn) | self.callbacks.fire("on_train_batch_end", self, loss)):
            return True
        live = self.live_settings  # the schedule, as the control plane may have changed it
        if _due(state.global_step, live.eval_every(cfg)) and self._act(self.evaluation()[1]):  # evaluate if due
            return True
        self.checkpoints.after_step(self, live.save_every(cfg))           # checkpoint if due
        return self._boundary()                                           # control boundary

    def _end_epoch(self, epoch: int) -> None:
        state = self.state
        state.batch_in_epoch, state.epoch = 0, epoch + 1
        if _due(epoch + 1, self.config.eval.every_n_epochs):
            self.evaluate()
        self.checkpoints.after_epoch(self)
        self._act(self.callbacks.fire("on_train_epoch_end", self))

    def _end_training(self) -> None:
        """The end: last evaluation, the schedule's last checkpoint, the final boundaries, the
        final model -- but a stop with save=false writes nothing (no checkpoint, no model)."""
        cfg, state, live = self.config, self.state, self.live_settings
        if cfg.eval.at_end and self.eval_dataset is not None and self._last_eval_step != state.global_step:
            asked = self.evaluation()[1]
            if asked.rewind is not None:  # as a command's rewind now: refused, the final weights stay
                self.emit(WarningEvent(message=f"{asked.reason}: the rewind to {asked.rewind} was refused: "
                                               "training has ended"))
            self._act(replace(asked, rewind=None))
        if live.final_save is not False:
            self.checkpoints.at_end(self, live.save_every(cfg))
        self._last_boundaries()
        self.callbacks.fire("on_train_end", self)
        if live.save_at_end(cfg):
            self.save_model(str(self.folder.model))
        self.emit(StateEvent(state=RunState.FINISHED, step=state.global_step))
        if self.control is not None:  # as a launched run ends: no control socket, no control.json left
            self.control.close()

    def _boundary(self) -> bool:
        """The control boundary: the queued commands run, a pause holds here. A command that moves
        the loop comes back as a signal, carried out (and answered) by `_act` before the boundary
        goes on. True when a rewind moved the data position."""
        if self.control is None:
            return False
        moved, signal = False, self.control.at_boundary()
        while signal is not None:
            moved = self._act(signal) or moved
            signal = self.control.go_on()
        return moved

    def _last_boundaries(self) -> None:
        """The end's boundaries: everything queued is answered (a pause holds the finished
        weights; a rewind or branch is refused), then the queue closes and what came in between
        is answered too."""
        if self.control is not None:
            self.control.finish()
            self._boundary()
            self.control.close_commands()
            self._boundary()

    def _act(self, signal: Signal) -> bool:
        """Carry out what hooks and commands asked -- the one place the loop's course changes --
        then answer the command that asked. True when a rewind or branch moved the data position
        (the loop starts its epoch again there)."""
        if signal.stop:
            self._stopping = True
        moved, pause = False, signal.pause
        if signal.rewind is not None:
            moved, refused = self._go_back(signal)
            pause = pause or refused
        if pause:
            self._pause(signal.reason)
        if signal.answer is not None and signal.rewind is None:  # a rewind's is answered by _go_back
            signal.answer.done()
        return moved

    def _go_back(self, signal: Signal) -> tuple[bool, bool]:
        """Rewind or branch to the signal's target: (the data position moved, the run pauses
        instead: a hook's rewind was refused). A command's is answered here."""
        try:
            if signal.branch is not None:
                result = self.branch(signal.rewind, signal.branch, signal.reason, signal.settings)  # type: ignore[arg-type]
            else:
                result = self.rewind(signal.rewind, reason=signal.reason)  # type: ignore[arg-type]
        except (CheckpointError, ValueError, rewinding.StateLost) as e:
            touched = getattr(e, "position_touched", False)  # undone: the epoch starts again there
            if signal.answer is not None:  # a command's: refused or failed, answered so
                signal.answer.failed(e)
                if isinstance(e, rewinding.StateLost):
                    raise
                return touched, False
            if not isinstance(e, CheckpointError):
                raise
            # refused (or failed and undone): the guard's fallback is a pause
            self.emit(WarningEvent(message=f"{signal.reason}: the rewind to {signal.rewind} was refused ({e}), "
                                           "so the run pauses"))
            return touched, True
        if signal.answer is not None:
            signal.answer.done(result)
        if signal.then_lr_scale is not None and self.control is not None:
            self.control.scale_lr(signal.then_lr_scale, signal.reason)
        return True, False

    def _pause(self, reason: str) -> None:
        if self.control is None:  # nothing could hold the run or resume it: said, not dropped
            self.emit(WarningEvent(message=f"{reason}: a pause needs the control plane (control.enabled), "
                                           "so the run goes on"))
            return
        self.control.pause(reason)

    def _done(self) -> bool:
        return self._stopping or self.state.global_step >= self.state.total_steps

    # -- going back (engine.checkpoint.rewind) --------------------------------------------------
    def rewind(self, target: str, reason: str = "user") -> rewinding.RewindResult:
        """Load a checkpoint or snapshot of this run's present branch (`target`: a snapshot name,
        `step-N` or N, or a checkpoint folder) into the running engines. Collective: every rank
        calls it at the same boundary. A refused or failed rewind changes nothing (RewindError,
        the same on every rank). Outside `train()`; inside it, a hook returns
        Signal(rewind=...) and the loop rewinds and starts its epoch again there."""
        return rewinding.rewind_in_place(self, target, reason)

    def branch(self, target: str, name: str, reason: str = "user",
               settings: dict[str, Any] | None = None) -> rewinding.RewindResult:
        """Rewind to `target` (any branch's) and go on as the new branch `name` of the run's tree
        (inside `train()`: Signal(rewind=target, branch=name))."""
        return rewinding.branch_in_place(self, target, name, reason, settings)

    # -- one step's pieces --------------------------------------------------------------------
    def compute_loss(self, batch: dict, model: Callable | None = None,
                     window: Window = PER_MICRO_BATCH) -> torch.Tensor:
        """Forward one micro-batch and return its loss (the model's own, or `loss_fn`'s): its
        mean, or with a token `window` (engine.steps.step_window) the sum of its token losses
        divided by the step's label tokens (`num_items_in_batch`, passed on to the model and to
        a `loss_fn` that names it).

        `model` replaces the engine's forward: the fused LOMO step calls the bare module, whose
        backward DeepSpeed does not tie to `engine.backward`.
        """
        forward = model if model is not None else self.engine
        return self.layout.compute_loss(self.ctx, batch, forward, self.loss_fn, window)

    def _reduce(self, loss: torch.Tensor, tokens: int) -> tuple[float, int]:
        """Mean loss and total real tokens over the data-parallel group (one small all-reduce).
        The mean of the ranks' losses is the step's loss (see engine.steps: with the token
        objective each rank returns its token-loss sum times dp_size / N)."""
        packed = torch.tensor([float(loss), float(tokens)], dtype=torch.float64)
        if self.env.world_size > 1:
            dist.all_reduce(packed, group=self.env.dp_group)
            packed[0] /= self.env.dp_size
        return float(packed[0]), int(packed[1])

    def _record(self, info: StepInfo) -> None:
        if not _due(info.step, self.config.logging.log_every_n_steps) and info.step != self.state.total_steps:
            return
        measured: dict[str, Any] = {}
        for monitor in self.monitors:
            measured.update(monitor.measure(self, info))
        self.emit(TrainEvent(step=info.step, epoch=info.epoch, total_steps=self.state.total_steps, **measured))

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
        """Run every evaluator (collective); training state, mode and RNG are left as they were.
        What the evaluation's hooks ask (early stopping's stop) is carried out at once."""
        results, asked = self.evaluation()
        self._act(asked)
        return results

    def evaluation(self) -> tuple[dict[str, float], Signal]:
        """Run every evaluator (collective); the results, and what the `on_evaluate_end` hooks ask
        of the loop (early stopping), for the caller to hand to the loop."""
        if self.eval_dataset is None:
            return {}, NOTHING
        self.callbacks.fire("on_evaluate_begin", self)
        results: dict[str, float] = {}
        with preserved_rng(), torch.no_grad():
            self.engine.eval()
            try:
                for evaluator in ([self.eval_fn] if self.eval_fn is not None else []) + list(self.evaluators):
                    results.update(self._evaluated(evaluator))
            finally:
                self.engine.train()
        self._last_eval_step = self.state.global_step
        self.checkpoints.note_evaluation(self.state.global_step, results)
        self.emit(EvalEvent(step=self.state.global_step, epoch=self.state.epoch,
                            **{f"eval/{k}": v for k, v in results.items()}))
        return results, self.callbacks.fire("on_evaluate_end", self, results)  # early stopping

    def _evaluated(self, evaluator: Any) -> dict[str, float]:
        """One evaluator's results; one that raises is reported (a warning naming it and the
        error) and the run goes on: an evaluation mistake never ends a run. (It must raise on
        every rank alike, as a bad task name or a bug does; a collective left half-done on one
        rank cannot be caught here.)"""
        try:
            return evaluator(self)
        except Exception as e:  # noqa: BLE001 - any evaluator's failure: reported, training goes on
            name = getattr(evaluator, "name", None) or getattr(evaluator, "__name__", type(evaluator).__name__)
            self.emit(WarningEvent(step=self.state.global_step, message=f"evaluator {name} failed at step "
                                   f"{self.state.global_step} and was skipped: {type(e).__name__}: {e}"))
            return {}

    # -- saving and loading (engine.checkpoint; the run's method and layout decide how) --------
    def save_model(self, path: str) -> None:
        """The model in Hugging Face format (plus tokenizer and config); only rank 0 writes."""
        checkpoint.save_model(self.ctx, path)
        self.callbacks.fire("on_save_model", self, path)

    def load_model(self, path: str) -> None:
        checkpoint.load_model(self.ctx, path)
        self.callbacks.fire("on_load_model", self, path)

    def save_peft(self, path: str, selected_adapters: list[str] | None = None) -> None:
        checkpoint.save_peft(self.ctx, path, selected_adapters)

    def load_peft(self, path: str, adapter_name: str = "default", is_trainable: bool = True) -> None:
        checkpoint.load_peft(self.ctx, path, adapter_name, is_trainable)

    def save_checkpoint(self, path: str, *, saved_by: str = "manual", metrics: dict | None = None) -> str:
        """Everything needed to continue bit for bit (model, optimizer, scheduler, position, RNG,
        the callbacks' and the loop's parts' states); returns the checkpoint's URL."""
        return checkpoint_state.save_checkpoint(self.ctx, path, states=self.part_states(),
                                                sampler=self.batch_sampler(), saved_by=saved_by,
                                                metrics=metrics)

    def load_checkpoint(self, path: str) -> None:
        checkpoint_state.load_checkpoint(self.ctx, path, sampler=self.batch_sampler(),
                                         restore_states=self.restore_part_states)

    def part_states(self) -> dict[str, Any]:
        """The states stored in a training checkpoint: each callback's, the checkpoint
        schedule's and the control plane's (on every rank: a callback may be collective)."""
        states = self.callbacks.state_dict(self)
        states[self.checkpoints.state_key] = self.checkpoints.state_dict()
        if self.control is not None:
            states["control"] = self.control.state_dict()
        return states

    def restore_part_states(self, states: dict[str, Any]) -> None:
        """Put back what `part_states` gave (a resume, a rewind)."""
        self.callbacks.load_state_dict(self, states)
        if self.checkpoints.state_key in states:
            self.checkpoints.load_state_dict(states[self.checkpoints.state_key])
        if self.control is not None and isinstance(states.get("control"), dict):
            self.control.load_state_dict(states["control"])

    def batch_sampler(self):
        """The run's batch sampler (built once): its state is the data order's identity."""
        if self._sampler is None:
            self._sampler = self.train_loader(0, start_batch=0).batch_sampler
        return self._sampler

    # -- data -----------------------------------------------------------------------------------
    @property
    def train_dataset(self):
        return self.data.train

    @property
    def eval_dataset(self):
        return self.data.eval

    @property
    def eval_rows(self) -> list | None:
        """The raw evaluation rows, for evaluators that generate and compare text."""
        return self.data.eval_rows

    @property
    def data_reports(self) -> dict:
        return self.data.reports

    def train_loader(self, epoch: int, start_batch: int = 0):
        return run_data.train_loader(self.ctx, self.data, epoch, start_batch)

    def eval_loader(self):
        return run_data.eval_loader(self.ctx, self.data)

    def _epochs(self) -> int:
        return run_data.epochs(self.config, run_data.micro_batches_per_epoch(self.ctx, self.data))

    # -- events ---------------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """Write an event (a model of contract.events) to events.jsonl (rank 0 only; other ranks' events are dropped)."""
        self.ctx.emit(event)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the control plane (answering what is still queued) and close the event log (again
        harmless; `with Trainer(...) as t:` calls it at the block's end)."""
        if self.control is not None:
            self.control.close()
        self.snapshots.close()
        if self.events is not None:
            self.events.close()
            self.events = None


def _chunks(iterable, size: int):
    chunk = []
    for item in iterable:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []


def _due(count: int, every: int) -> bool:
    return every > 0 and count > 0 and count % every == 0
