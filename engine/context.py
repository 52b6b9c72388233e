"""The run context: the parts of one run, built once by `engine.assembly`, handed to the engine.

The engine's layers (layouts, methods, checkpoints, generation) take a `RunContext` rather than
the Trainer: it names what they may use, and keeps them from reaching into the loop. The
Trainer holds one (`trainer.ctx`) and shows its fields as its own attributes, so a function that
takes a context also accepts the Trainer (CoLLie's API hands the trainer to callbacks,
monitors, evaluators and `train_fn`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager, Protocol

import torch
from torch import nn

from contract import capabilities
from contract.config.schema import RunConfig
from contract.events import Event
from contract.run_folder import EventLog, RunFolder
from engine.control.settings import LiveSettings
from engine.objectives.losses import PER_MICRO_BATCH, Window
from engine.steps import StepStrategy


@dataclass
class TrainerState:
    """Where the trainer is; saved in checkpoints so that a resumed run skips exactly what it did."""
    epoch: int = 0
    batch_in_epoch: int = 0   # micro-batches of the current epoch already trained
    global_step: int = 0      # optimizer steps done
    total_steps: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DistEnv:
    """This rank's place in the process group and the run's tp x pp x dp layout."""
    rank: int
    local_rank: int
    world_size: int
    dp_rank: int          # which data-parallel replica this rank is part of (its data shard)
    dp_size: int
    dp_group: object      # the ranks that hold the same layers on other data (None: the world)
    device: torch.device
    tp_size: int = 1      # tensor-parallel ranks per replica (engine.parallel.groups)
    tp_rank: int = 0
    pp_size: int = 1      # pipeline stages per replica
    stage: int = 0        # this rank's pipeline stage
    topology: object = None  # the pipeline's DeepSpeed ProcessTopology when pp_size > 1


class Layout(Protocol):
    """What differs between data-parallel, tensor-parallel and pipeline runs (the objects are in
    engine.parallel.layouts; `run` is the RunContext)."""
    name: str
    kind: capabilities.Layout  # its row in the capability table
    split: bool  # the engine holds a shard or a stage of the model, not all of it

    def prepare_model(self, model: nn.Module, cfg: RunConfig, loss_fn: Callable | None) -> nn.Module: ...
    def whole_model_parameters(self, model: nn.Module) -> int | None: ...
    def mpu(self) -> Any: ...
    def step(self) -> StepStrategy: ...
    def compute_loss(self, run, batch: dict, forward: Callable, loss_fn: Callable | None,
                     window: Window = PER_MICRO_BATCH) -> torch.Tensor: ...
    def generate(self, run, prompts: list[str], **options) -> list[str]: ...
    def logit_summary(self, run, inputs: dict, summarize: Callable, shape: tuple) -> torch.Tensor: ...
    def full_state_dict(self, run) -> dict[str, torch.Tensor] | None: ...
    def load_full_state_dict(self, run, state_dict: dict[str, torch.Tensor]) -> None: ...
    def save_model(self, run, path: str, max_shard_size: int | str) -> dict: ...
    def load_model(self, run, path: str) -> None: ...
    def checkpoint_client_state(self) -> dict: ...


class Method(Protocol):
    """What differs between full fine-tuning, PEFT adapters and the fused LOMO / AdaLomo update
    (the objects are in engine.model.methods; `run` is the RunContext)."""
    name: str
    builds_optimizer: bool  # False: the method makes its own optimizer once the engine exists
    has_adapter: bool       # True: `base_model` answers without the trained adapter
    targets_shifted: bool   # True: a row's first label is never a target (engine.objectives.losses counts)

    def prepare_model(self, model: nn.Module, cfg: RunConfig) -> nn.Module: ...
    def adjust_ds_setup(self, setup) -> None: ...
    def check_optimizer(self, optimizer) -> None: ...
    def optimizer_after_engine(self, engine, cfg: RunConfig, setup, env: "DistEnv") -> Any: ...
    def grad_clip(self, run: "RunContext") -> float: ...
    def set_grad_clip(self, run: "RunContext", value: float) -> None: ...
    def step(self, layout: Layout) -> StepStrategy: ...
    def base_model(self, module) -> ContextManager: ...
    def save_model(self, run, path: str, max_shard_size: int | str) -> dict: ...
    def load_model(self, run, path: str) -> None: ...
    def save_peft(self, run, path: str, selected_adapters: list[str] | None) -> dict: ...
    def load_peft(self, run, path: str, adapter_name: str, is_trainable: bool) -> None: ...


@dataclass
class RunContext:
    """Everything about one run that the engine's layers read: decided once, at assembly.

    `layout` (data-parallel / tensor-parallel / pipeline) and `method` (full / PEFT / fused) are
    the objects that carry every operation in which layouts or methods differ. `engine`,
    `optimizer` and `lr_scheduler` are set once DeepSpeed has been initialised.
    """
    config: RunConfig
    env: DistEnv
    layout: Layout
    method: Method
    precision: str
    tokenizer: Any
    folder: RunFolder
    events: EventLog | None
    state: TrainerState
    engine: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    # what `set` (and `stop`) changed while the run goes on (engine.control.settings): the loop
    # reads its schedule and final save from it, the control plane's handlers write it
    settings: LiveSettings = field(default_factory=LiveSettings)

    def emit(self, event: Event) -> None:
        """Write an event (a model of contract.events) to events.jsonl (rank 0 only; other ranks' events are dropped)."""
        if self.events is not None:
            self.events.emit(event)
