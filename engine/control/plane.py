"""The control plane of one run: server (rank 0), boundary exchange and handlers (every rank).

`Control.at_boundary()` is called by every rank between optimizer steps. It takes the batch of
queued commands from rank 0, executes them in order, and while the run is paused keeps
exchanging (an empty batch at least every HEARTBEAT_S seconds), so the waiting ranks sit in a
broadcast that completes long before any gloo / nccl timeout, and resume the moment rank 0 does.
A command that moves the loop (pause, stop, rewind, branch: engine.control.moves) is not carried
out here: its signal goes back to the loop (`Trainer._act`), which acts, answers it, and calls
`go_on` for the rest of the boundary.

At the end of training the queue is drained once more (`finish`, then `close_commands`, the loop
running a boundary after each), so chats sent during the last step are answered; a pause that
arrives then holds the finished weights in memory for chat until resumed or stopped, and a rewind
or branch is refused. After that the run accepts no more commands: each gets an error saying training has
ended (status and subscribe still answer until the process exits), so nothing queued is met by
silence.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import replace
from typing import Any

from contract.events import ChatPageEvent, CommandEvent, CommandStatus, EventType, WarningEvent, state_event
from contract.protocol.commands import Set, Status
from contract.protocol.answers import StatusAnswer
from contract.protocol.completion_commands import Complete
from contract.protocol.states import STATES, RunState
from engine.callbacks import Signal
from engine.control import chat_only
from engine.control.moves import Deferred, Move
from engine.checkpoint.rewind import StateLost
from engine.control import completions, data_commands, handlers, live_fields
from engine.control.boundary import Boundary
from engine.control.chat_page import ChatPage
from engine.control.handlers import CommandRefused, HANDLERS
from engine.control.pending import NO_REPLY, CommandQueue, Pending
from engine.control.run import ControlledRun
from engine.control.server import ControlServer
from engine.control.serving import ServingBudget
from engine.control.limits import PromptLimit

# while paused: the longest the other ranks wait in one broadcast (far below any gloo / nccl
# timeout); tests shorten it to exercise many heartbeats
HEARTBEAT_S = float(os.environ.get("LIVETUNE_HEARTBEAT_S", "5"))


class Control:
    """The control plane of one run (every rank builds one; rank 0's also serves the socket)."""

    def __init__(self, trainer: ControlledRun, chat_page: bool = False):
        self.trainer = trainer
        env = trainer.env
        self.rank, self.world_size = env.rank, env.world_size
        commands = CommandQueue() if self.rank == 0 else None
        self.commands = commands
        self.boundary = Boundary(self.rank, self.world_size, env.device, commands)
        # the live settings `set` changed: recorded in every checkpoint, re-applied on resume;
        # the loop reads its schedule from them (trainer.live_settings)
        self.settings = trainer.ctx.settings  # built with the run's context (engine.assembly)
        self._left: list[Pending] = []  # the boundary's commands not executed yet
        live_fields.remember(trainer, self.settings)  # the optimizer's own fields, before any load
        self.ended = False
        self.finishing = False  # the end of training's last boundaries: every request answered
        # how much of the run's time the OpenAI-compatible API's requests may take (rank 0 decides)
        self.serving = ServingBudget(trainer.config.control.serving_budget)
        self.boundary.hold = self._held if commands is not None else None
        self.paused = False    # held at the boundary (pause; the guard's pause through the loop)
        self.stopping = False  # a stop was executed: the loop ends after this boundary
        self.state: RunState = RunState.STARTING
        self.last_train: dict | None = None
        self.last_eval: dict | None = None
        self.server: ControlServer | None = None
        self.page: ChatPage | None = None
        if commands is not None:  # rank 0
            cfg = trainer.config.control
            # a prompt longer than the model's context is refused before it is queued
            prompts = PromptLimit.of(trainer.engine.module, trainer.tokenizer, handlers.prompt_text,
                                     lambda: self.settings.generation_params()["max_new_tokens"])
            self.server = ControlServer(trainer.folder, commands, self.status_snapshot,
                                        host=cfg.host, port=cfg.port, on_queued=self._on_queued,
                                        admit=prompts)
            if trainer.events is not None:
                trainer.events.subscribe(self._on_event)
            self.server.start()
            if chat_page:
                self.page = ChatPage(self.server, host=cfg.host).start()
                # the token stays out of events.jsonl (readable by others): control.json has it
                self.server.write_control_file(chat_page=self.page.url)
                trainer.emit(ChatPageEvent(url=self.page.url.split("?")[0],
                                           note="open the URL printed by rank 0, or chat_page in control.json"))
                print(f"chat with the model being trained: {self.page.url}", flush=True)

    # -- the boundary ------------------------------------------------------------------------------
    def at_boundary(self) -> Signal | None:
        """A boundary: execute what was queued, and hold while paused (collective: every rank
        calls it). A command that moves the loop (engine.control.moves) ends the run of commands
        there: its signal is returned for the loop to carry out, and `go_on` continues with the
        commands after it. None: the boundary is over."""
        self.serving.begin()
        data_commands.at_boundary(self)  # taught prompts asked again when their check is due
        self._left = self.boundary.exchange()
        return self.go_on()

    def go_on(self) -> Signal | None:
        """The boundary after the loop acted on a command's signal: the commands left, then the
        hold while paused (the same on every rank: each has the same batch)."""
        while True:
            signal = self._execute(self._left)
            if signal is not None or not self.paused or self.stopping:
                return signal
            self._left = self.boundary.exchange(wait_s=HEARTBEAT_S)

    def pause(self, reason: str = "user") -> None:
        """Hold at the boundary from now on (every rank alike), with a `state` paused event (a
        chat-only run's names the model it holds). The loop calls it (`Trainer._act`)."""
        if not self.paused:
            self.paused = True
            self.emit_state(RunState.PAUSED, **chat_only.state_fields(self.trainer.config))

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            self.emit_state(RunState.RUNNING)

    def stop(self) -> None:
        """End training after this boundary (a pause ends with it)."""
        self.stopping, self.paused = True, False
        self.emit_state(RunState.STOPPING)

    def scale_lr(self, factor: float, reason: str) -> None:
        """Multiply the learning rate by `factor` as a `set lr_scale` would (a `set` event, kept in
        later checkpoints); refused: a warning event."""
        try:
            handlers.set_values(self, Set(lr_scale=self.settings.lr_scale * factor), NO_REPLY)
        except CommandRefused as e:
            self.trainer.emit(WarningEvent(message=f"{reason}: the learning rate was not scaled: {e}"))

    def finish(self) -> None:
        """The end of training's boundaries begin: every request is answered, a pause holds the
        finished weights, a rewind or branch is refused (the final weights are the run's)."""
        self.finishing = True

    def close_commands(self) -> None:
        """After the end's first boundary: refuse what comes later (the loop then runs one more
        boundary, so what arrived between the two is executed, not dropped)."""
        self.ended = True
        if self.commands is not None:
            self.commands.close(f"training has ended (step {self.trainer.state.global_step}); the run "
                                "takes no more commands")

    def _execute(self, items: list[Pending]) -> Signal | None:
        """Execute in order, taking them from `items`; consecutive `complete` commands together
        (one batched generation). Stops at a command that moves the loop: its signal."""
        while items:
            end = 0
            while end < len(items) and isinstance(items[end].command, Complete):
                end += 1
            started, charged = time.perf_counter(), end > 0 and self._charged()
            signal = None
            if end > 1:
                self._execute_completions(items[:end])
                del items[:end]
            else:
                signal = self._execute_one(items.pop(0))
            if charged:
                self.serving.charge(time.perf_counter() - started)
            if signal is not None:
                return signal
        return None

    def _charged(self) -> bool:
        """Whether serving now takes training's time (the serving budget): not while paused, not
        at the end of training."""
        return not (self.paused or self.finishing)

    def _held(self, item: Pending) -> bool:
        """Rank 0, before the boundary's commands go to every rank: a `complete` waits while the
        serving budget is spent (engine.control.serving)."""
        if not isinstance(item.command, Complete) or not self._charged() or self.serving.allows():
            return False
        self.serving.held += 1
        return True

    def _execute_completions(self, items: list[Pending]) -> None:
        """Several requests of the OpenAI-compatible API at once (engine.control.completions)."""
        started = time.perf_counter()
        try:
            outcomes = completions.complete_many(self, [(item.command, item.reply) for item in items])
        except Exception as e:  # noqa: BLE001 - failed commands are answered; training goes on
            traceback.print_exc()
            for item in items:
                self.answer_error(item, f"{item.cmd} failed: {type(e).__name__}: {e}")
            return
        seconds = round(time.perf_counter() - started, 4)
        for item, outcome in zip(items, outcomes):
            if isinstance(outcome, completions.CompletionRefused):
                self.answer_error(item, str(outcome))
            else:
                self._record(item, CommandStatus.DONE, result=outcome, seconds=seconds)
                item.reply.done(outcome)

    def _execute_one(self, item: Pending) -> Signal | None:
        started = time.perf_counter()
        try:
            result = HANDLERS[type(item.command)](self, item.command, item.reply)
        except CommandRefused as e:
            self.answer_error(item, str(e))
        except StateLost as e:  # the run cannot go on (every rank alike): answered, then it ends
            self.answer_error(item, f"{item.cmd} failed: {e}")
            raise
        except Exception as e:  # noqa: BLE001 - a failed command is answered; training goes on
            traceback.print_exc()  # to this rank's log; the answer names the error
            self.answer_error(item, f"{item.cmd} failed: {type(e).__name__}: {e}")
        else:
            if isinstance(result, Move):  # the loop acts first, then answers (engine.control.moves)
                return replace(result.signal, answer=Deferred(self, item, result, started))
            self.answer_done(item, result, round(time.perf_counter() - started, 4))
        return None

    def answer_done(self, item: Pending, result: dict, seconds: float) -> None:
        """Recorded first: whoever hears `done` finds the effect in the event log."""
        self._record(item, CommandStatus.DONE, result=result, seconds=seconds)
        item.reply.done(result)

    def answer_error(self, item: Pending, message: str) -> None:
        self._record(item, CommandStatus.FAILED, error=message)
        item.reply.error(message)

    # -- events and status -------------------------------------------------------------------------
    def emit_state(self, state: RunState, **fields: Any) -> None:
        self.trainer.emit(state_event(state, step=self.trainer.state.global_step, **fields))

    def _record(self, item: Pending, status: CommandStatus, **fields: Any) -> None:
        if isinstance(item.command, Status) or self.trainer.events is None:  # reads change nothing
            return
        self.trainer.emit(CommandEvent(id=item.id, cmd=item.cmd, status=status,
                                       step=self.trainer.state.global_step, **fields))

    def _on_queued(self, item: Pending) -> None:
        if not isinstance(item.command, Status):
            self.trainer.emit(CommandEvent(id=item.id, cmd=item.cmd, status=CommandStatus.QUEUED,
                                           args=item.args, step=self.trainer.state.global_step))

    def _on_event(self, event: dict) -> None:
        kind = event.get("type")
        if kind == EventType.STATE.value:
            if event.get("state") in STATES:  # a state this version does not know leaves it be
                self.state = RunState(event["state"])
        elif kind == EventType.TRAIN.value:
            self.last_train = event
        elif kind == EventType.EVAL.value:
            self.last_eval = event
        if self.server is not None:
            self.server.notify(event)

    def status_snapshot(self) -> StatusAnswer:
        """The run as rank 0 sees it now (read from the server thread: plain values only)."""
        t = self.trainer
        return StatusAnswer(
            step=t.state.global_step, epoch=t.state.epoch, total_steps=t.state.total_steps, state=self.state,
            paused=self.paused, queue=len(self.commands or ()),
            accepting=self.commands.closed is None if self.commands is not None else False,
            last_train=self.last_train, last_eval=self.last_eval, settings=handlers.current_settings(self),
            world_size=self.world_size, sources=data_commands.sources_snapshot(self),
            memory_mb={"0": handlers.memory_mb()}, memory_of="rank 0 only (ranks=true: every rank)",
            serving=self.serving.snapshot(),
            boundary={"idle_exchanges": self.boundary.idle_exchanges, "idle_seconds": self.boundary.idle_seconds})

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self) -> str:
        """A training checkpoint of the present step (collective), in the run's checkpoints/."""
        path = self.trainer.folder.checkpoints / f"step-{self.trainer.state.global_step}"
        self.trainer.save_checkpoint(str(path))
        return str(path)

    def state_dict(self) -> dict:
        """What training checkpoints record of the control plane: the live settings."""
        return {"settings": self.settings.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.settings.load_state_dict(state.get("settings", {}))
        handlers.apply_settings(self)

    # -- the end -------------------------------------------------------------------------------------
    def close(self, reason: str | None = None) -> None:
        """Answer whatever is still queued with an error, end every connection (every rank calls
        it; only rank 0 has anything to close)."""
        if self.commands is None:
            return
        reason = reason or f"the run has ended ({self.state.value}); the command was not executed"
        self.commands.close(reason)
        for item in self.commands.drain():
            self.answer_error(item, reason)
        if self.page is not None:
            self.page.close()
        if self.server is not None:
            self.server.close()
            self.server = None

