"""What a run's events.jsonl says about it, folded incrementally (a long run's log is read once).

The event types read here are the engine's: `state` (starting, running, paused, stopping,
finished, failed), `setup` (total steps), `train` (one record per logged step), `eval`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contract.protocol.states import RunState

from supervisor.judgement import cause_first

# Events that show the training loop itself moving. Command acknowledgements and the like are
# written by rank 0's control thread even when the loop is stuck, so they do not count.
PROGRESS_EVENTS = ("train", "eval", "state", "setup", "heartbeat", "checkpoint")

# a train record's bookkeeping fields, not metrics
_NOT_METRICS = ("type", "step", "epoch", "total_steps", "time", "line")


@dataclass
class RunSummary:
    """The run as its event log tells it, so far."""
    state: str | None = None           # the last `state` event's state (a RunState value)
    step: int = 0
    epoch: int = 0
    total_steps: int | None = None
    train_metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    start_time: float | None = None    # time of the first event
    end_time: float | None = None      # time of the final state event
    method: str | None = None          # the training method the run's state events name
    error: str | None = None           # the final `failed` event's reason, its cause first
    reason: str | None = None          # why a finished run ended (a stop, a cancelled Slurm job)
    error_rank: int | None = None
    final_source: str | None = None    # "manager" when the run manager wrote the final state
    stopped_by_user: bool = False
    events: int = 0

    @property
    def run_state(self) -> RunState | None:
        """The last state as the contract's enum (None before any state event)."""
        return RunState(self.state) if self.state is not None else None

    @property
    def final(self) -> bool:
        return self.state is not None and RunState(self.state).final

    @property
    def metrics(self) -> dict[str, float]:
        """The latest training record's numbers plus the latest evaluation's (eval/...)."""
        return {**self.train_metrics, **self.eval_metrics}

    def update(self, events: list[dict[str, Any]]) -> bool:
        """Fold new events in; True when one of them shows the training loop progressing."""
        progressed = False
        for event in events:
            self.events += 1
            kind = event.get("type")
            if self.start_time is None and isinstance(event.get("time"), (int, float)):
                self.start_time = float(event["time"])
            progressed = progressed or kind in PROGRESS_EVENTS
            handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is not None:
                handler(self, event)
        return progressed

    def _on_state(self, event: dict) -> None:
        try:
            state = RunState(event.get("state")).value
        except ValueError:
            return  # not a state this contract knows: not the run's state
        # the last state event wins: a run resumed in its own folder starts over after it finished
        was_stopping = self.state == RunState.STOPPING  # the run ends after a `stop` command
        self.state = state
        self.method = event.get("method", self.method)
        self.step = _int(event.get("step"), self.step)
        self.end_time, self.error, self.error_rank, self.reason = None, None, None, None
        self.final_source, self.stopped_by_user = None, False
        if RunState(state).final:
            self.end_time = event.get("time")
            self.final_source = event.get("source")
            self.stopped_by_user = was_stopping or bool(event.get("stopped_by_user", False))
            self.reason = str(event["reason"]) if event.get("reason") else None
        if state == RunState.FAILED:
            self.error = cause_first(str(event.get("error") or RunState.FAILED))
            self.error_rank = event.get("rank") if isinstance(event.get("rank"), int) else None

    def _on_setup(self, event: dict) -> None:
        self.total_steps = _int(event.get("total_steps"), self.total_steps)

    def _on_train(self, event: dict) -> None:
        self.step = _int(event.get("step"), self.step)
        self.epoch = _int(event.get("epoch"), self.epoch)
        self.total_steps = _int(event.get("total_steps"), self.total_steps)
        self.train_metrics = {k: v for k, v in event.items()
                              if k not in _NOT_METRICS and _number(v)}

    def _on_eval(self, event: dict) -> None:
        self.eval_metrics = {k: v for k, v in event.items() if k.startswith("eval/") and _number(v)}


_HANDLERS = {"state": RunSummary._on_state, "setup": RunSummary._on_setup,
             "train": RunSummary._on_train, "eval": RunSummary._on_eval}


def _int(value: Any, default: Any) -> Any:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
