"""What a run's events.jsonl says about it, folded incrementally (a long run's log is read once).

The event types read here are the engine's: `state` (starting, running, paused, stopping,
finished, failed), `setup` (total steps), `train` (one record per logged step), `eval`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from contract.events import (CheckpointEvent, EvalEvent, Event, SetupEvent, StateEvent, TrainEvent, as_event,
                             metric_numbers)
from contract.protocol.states import RunState

from supervisor.judgement import cause_first

# Events that show the training loop itself moving. Command acknowledgements and the like are
# written by rank 0's control thread even when the loop is stuck, so they do not count.
PROGRESS_EVENTS = (TrainEvent, EvalEvent, StateEvent, SetupEvent, CheckpointEvent)
# an older engine's liveness beat: no model (contract.events reads it as a plain Event), still progress
HEARTBEAT = "heartbeat"


@dataclass
class RunSummary:
    """The run as its event log tells it, so far."""
    state: str | None = None           # the last `state` event's state (a RunState value)
    step: int = 0
    epoch: int = 0
    total_steps: int | None = None
    start_time: float | None = None    # time of the first event
    end_time: float | None = None      # time of the final state event
    method: str | None = None          # the training method the run's state events name
    error: str | None = None           # the final `failed` event's reason, its cause first
    reason: str | None = None          # why a finished run ended (a stop, a cancelled Slurm job)
    error_rank: int | None = None
    final_source: str | None = None    # "manager" when the run manager wrote the final state
    stopped_by_user: bool = False
    events: int = 0
    # the latest `train` and `eval` events: their numbers are read when asked for, not at every
    # record folded in (a reattach folds a long run's whole log)
    last_train: TrainEvent | None = field(default=None, repr=False)
    last_eval: EvalEvent | None = field(default=None, repr=False)

    @property
    def run_state(self) -> RunState | None:
        """The last state as the contract's enum (None before any state event)."""
        return RunState(self.state) if self.state is not None else None

    @property
    def final(self) -> bool:
        return self.state is not None and RunState(self.state).final

    @property
    def train_metrics(self) -> dict[str, float]:
        """The latest training record's numbers (contract.events.metric_numbers)."""
        return metric_numbers(self.last_train) if self.last_train is not None else {}

    @property
    def eval_metrics(self) -> dict[str, float]:
        """The latest evaluation's numbers, by their `eval/...` names."""
        return metric_numbers(self.last_eval) if self.last_eval is not None else {}

    @property
    def metrics(self) -> dict[str, float]:
        """The latest training record's numbers plus the latest evaluation's (eval/...)."""
        return {**self.train_metrics, **self.eval_metrics}

    def update(self, events: Iterable[Event | dict[str, Any]]) -> bool:
        """Fold new events in (models, or read JSON objects: each parsed once, one that does not
        match its model skipped); True when one of them shows the training loop progressing."""
        progressed = False
        for raw in events:
            self.events += 1
            event = as_event(raw)
            if event is None:
                continue
            if self.start_time is None and event.time is not None:
                self.start_time = float(event.time)
            progressed = progressed or isinstance(event, PROGRESS_EVENTS) or event.type == HEARTBEAT
            if isinstance(event, StateEvent):
                self._on_state(event)
            elif isinstance(event, SetupEvent):
                self.total_steps = _int(event.total_steps, self.total_steps)
            elif isinstance(event, TrainEvent):
                self._on_train(event)
            elif isinstance(event, EvalEvent):
                self.last_eval = event
        return progressed

    def _on_state(self, event: StateEvent) -> None:
        if event.state is None:
            return  # no state named: not the run's state
        state = RunState(event.state).value
        # the last state event wins: a run resumed in its own folder starts over after it finished
        was_stopping = self.state == RunState.STOPPING  # the run ends after a `stop` command
        self.state = state
        self.method = event.method if "method" in event.model_fields_set else self.method
        self.step = _int(event.step, self.step)
        self.end_time, self.error, self.error_rank, self.reason = None, None, None, None
        self.final_source, self.stopped_by_user = None, False
        if RunState(state).final:
            self.end_time = event.time
            self.final_source = event.source
            self.stopped_by_user = was_stopping or bool(event.stopped_by_user)
            self.reason = str(event.reason) if event.reason else None
        if state == RunState.FAILED:
            self.error = cause_first(str(event.error or RunState.FAILED))
            self.error_rank = event.rank

    def _on_train(self, event: TrainEvent) -> None:
        self.step = _int(event.step, self.step)
        self.epoch = _int(event.epoch, self.epoch)
        self.total_steps = _int(event.total_steps, self.total_steps)
        self.last_train = event


def _int(value: Any, default: Any) -> Any:
    return value if isinstance(value, int) and not isinstance(value, bool) else default

