"""What the control plane uses of the run it drives, and what a handler uses of the control
plane, written down as typing Protocols.

The Trainer provides all of it; the control plane never imports the trainer (arrows point down),
it is handed one object with these attributes. Anything the handlers need from the run that is
not listed here is a dependency to add here first.
"""

from __future__ import annotations

from typing import Any, Protocol

from contract.config.schema import RunConfig
from contract.protocol.states import RunState
from contract.events import Event
from contract.run_folder import EventLog, RunFolder
from engine.context import RunContext
from engine.control.settings import LiveSettings


class ControlledRun(Protocol):
    ctx: RunContext            # the run's parts (what generation and checkpoints take)
    config: RunConfig          # as started: the control plane never writes it
    env: Any                   # engine.context.DistEnv: rank, world_size, device
    folder: RunFolder
    events: EventLog | None    # rank 0's event log (None on other ranks)
    state: Any                 # engine.context.TrainerState: global_step, epoch, total_steps
    tokenizer: Any
    engine: Any                # the DeepSpeed engine (read: gradient_clipping(), module, optimizer)
    ds_setup: Any              # engine.parallel.ds_config.DeepSpeedSetup: the DeepSpeed config it was built from
    method: Any                # engine.model.methods: the method object (`has_adapter`: a base model to compare)
    optimizer: Any             # the engine's optimizer, or the fused LOMO one (None: no optimizer)
    eval_dataset: Any          # None: the run has no evaluation data
    live_settings: LiveSettings  # ctx.settings: what `set` changed

    def emit(self, event: Event) -> None:
        """Write an event to events.jsonl (rank 0)."""

    def current_lr(self) -> float:
        """The learning rate of the next step."""

    def set_lr(self, lr: float) -> None:
        """Make the next step's learning rate `lr`; the schedule goes on from there, scaled."""

    def scale_lr(self, factor: float) -> None:
        """Scale the learning-rate schedule by `factor`."""

    def evaluate(self) -> dict:
        """Run the evaluation now (collective); its metrics."""

    def evaluation(self) -> tuple[dict, Any]:
        """Run the evaluation now (collective); its metrics, and the Signal its hooks answered
        (early stopping), for the loop to act on."""

    def save_checkpoint(self, path: str) -> Any:
        """Write a training checkpoint of the present step at `path` (collective)."""


class Plane(Protocol):
    """What a command handler uses of the control plane (engine.control.plane.Control)."""
    trainer: ControlledRun
    settings: LiveSettings
    rank: int
    world_size: int
    finishing: bool            # the end's boundaries: rewind and branch are refused
    ended: bool                # training has ended: pause has nothing left to hold
    paused: bool               # the boundary holds while true

    def pause(self, reason: str = "user") -> None:
        """Hold at the boundary (a `state` paused event)."""

    def resume(self) -> None:
        """Stop holding (a `state` running event)."""

    def stop(self) -> None:
        """End training after this boundary (a `state` stopping event)."""

    def emit_state(self, state: RunState) -> None:
        """Record a run state change (a `state` event)."""

    def save_checkpoint(self) -> str:
        """A training checkpoint of the present step (collective); its path."""

    def status_snapshot(self) -> dict:
        """The run as rank 0 sees it now."""
