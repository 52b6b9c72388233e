"""The live control plane: chat with the weights being trained, pause, set, save, stop.

    rank 0: ControlServer (socket thread) -> CommandQueue
    every rank, at each step boundary: Boundary.exchange() -> handlers, in the same order

The composition root builds it when the config enables it (`control.enabled`, or
`Trainer(server=True)` for the chat page: engine.assembly.loop.control_of) and the Trainer
declares it (`trainer.control`). Protocol: contract.protocol; client: supervisor.client.RunClient.

Behaviour a user can count on:
- Every accepted command is answered: `done` with its result, or `error` with the reason
  (refused in the run's state, failed, or the run ended before it could run). It is recorded in
  events.jsonl (queued, then done / failed) before its sender hears the answer.
- Commands run between optimizer steps (after the step, with gradient accumulation after the
  last micro-batch), before the first step, and once more after the last one.
- Commands that move the loop (pause, stop, rewind, branch) return a Signal (engine.callbacks);
  the loop carries it out (`Trainer._act`, the one place its course changes) and then answers
  the command; the boundary goes on with the commands after it.
- `pause` keeps everything in memory; chat, evaluate, save, set and status work while paused.
  A pause that arrives at the very end holds the finished weights for chat until resume / stop;
  a rewind or branch that arrives then is refused (the final weights are the run's).
- Once training has ended the run takes no new commands (a clear error says so); `status` and
  `subscribe` answer until the process exits.
- `stop` saves by default: a training checkpoint at once, and the final model when the run ends;
  `stop(save=false)` saves neither. A failed save fails the stop, so nothing is lost.
- `status` is answered at once with rank 0's memory; `status(ranks=true)` waits for the
  boundary and gathers every rank's.
- `set` changes are kept in one `LiveSettings` object (engine.control.settings), built by the
  assembly with the run's context (`trainer.live_settings`, `ctx.settings`), never in the run
  config; recorded as `set` events, stored in every training checkpoint and applied again on
  resume. The loop reads its eval / checkpoint schedule and the final save from it.
- Commands are contract.protocol models from the socket to the handler: each handler
  receives its typed command (engine.control.handlers.HANDLERS, keyed by command type).
"""
