"""The command handlers, run at a step boundary by every rank in the same order.

A handler gets the control plane, the command (a contract.protocol pydantic model, already
validated) and the reply to its sender (a silent one on ranks other than 0) and returns the
result sent back as `done`. It raises :class:`CommandRefused` when the command cannot apply in
the run's present state; every rank refuses alike, because every rank sees the same state and
command, so collective work is never entered by some ranks only.

Live settings go into `control.settings` (engine.control.settings.LiveSettings), never into the
run config; gradient clipping changes through the method object (DeepSpeed's, or LOMO's own).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist

from contract.events import BranchEvent, SetEvent
from contract.protocol.data_commands import AddSource, Forget, Inbox, RemoveSource, SetWeight, Teach
from contract.protocol.branch_commands import Branch, Branches, Rewind, Snapshot
from contract.protocol.base import Command
from contract.protocol.answers import StatusAnswer
from contract.protocol.completion_commands import Complete
from contract.protocol.commands import Evaluate, Generate, Pause, Resume, Save, Set, Status, Stop
from contract.protocol.rating_commands import Rate, RateChat
from contract.protocol.reward_commands import AddReward, RemoveReward
from contract.protocol.states import RunState
from engine.checkpoint import rewind as rewinding
from engine.checkpoint.locations import CheckpointError
from engine.control import completions, data_commands
from engine.callbacks import NOTHING, Signal
from engine.control.moves import Move
from engine.control.pending import Reply
from engine.control.run import Plane
from engine.control import live_fields
from engine.control.settings import REPLACED
from engine.generation.generate import fresh_seed
from engine.generation.generate import generate as generate_text
from engine.objectives import grpo_chat, grpo_samples
from engine.objectives import grpo_live


class CommandRefused(RuntimeError):
    """The command does not apply now (same on every rank); nothing was changed."""


Handler = Callable[[Plane, Any, Reply], Any]  # the answer (a dict), or a Move for the loop


# -- generate -------------------------------------------------------------------------------------
def generate(control: Plane, cmd: Generate, reply: Reply) -> dict:
    trainer = control.trainer
    params = control.settings.generation_params(cmd.sampling())
    if params["seed"] is None:  # unseeded: a fresh seed, reported so the sample can be repeated
        params["seed"] = fresh_seed()
    prompt = prompt_text(trainer.tokenizer, cmd)
    step = trainer.state.global_step
    streams = control.rank == 0
    ratings = grpo_samples.ratings_of(trainer)  # a GRPO run keeps its chat answers for rate_chat
    captured: list[list[int]] = []
    text = generate_text(trainer.ctx, [prompt], **params,
                         on_text=(lambda t: reply.token(t, "current")) if streams else None,
                         **({"on_ids": captured.extend} if ratings is not None else {}))[0]
    if ratings is not None and captured:
        grpo_chat.keep_answer(ratings, trainer, step, prompt, cmd.messages if cmd.messages is not None else cmd.prompt,
                              text, captured[0])
    result: dict[str, Any] = {"text": text, "step": step, "model": "current", "seed": params["seed"]}
    if cmd.compare_base:
        if trainer.method.has_adapter:
            result["base"] = generate_text(trainer.ctx, [prompt], **params, use_base=True,
                                           on_text=(lambda t: reply.token(t, "base")) if streams else None)[0]
        else:
            result["base"] = None
            result["note"] = "no PEFT adapter is training, so there is no separate base model to compare"
    return result


def prompt_text(tokenizer, cmd: Generate | Teach | RateChat) -> str:
    """The text the model continues: the chat template applied to `messages`, or `prompt` with
    the BOS token the tokenizer puts in front of every training sample."""
    if cmd.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise CommandRefused("generate: this model's tokenizer has no chat template; send `prompt`")
        return tokenizer.apply_chat_template(cmd.messages, tokenize=False, add_generation_prompt=True)
    prompt = cmd.prompt or ""
    bos = tokenizer.bos_token
    if bos and _adds_bos(tokenizer) and not prompt.startswith(bos):
        prompt = bos + prompt
    if not prompt:
        raise CommandRefused("generate: the prompt is empty")
    return prompt


def _adds_bos(tokenizer) -> bool:
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bool(with_special) and with_special[0] == tokenizer.bos_token_id


def complete(control: Plane, cmd: Complete, reply: Reply) -> dict:
    """Completions with token log-probabilities (the OpenAI-compatible API): engine.control.completions."""
    try:
        return completions.complete(control, cmd, reply)
    except completions.CompletionRefused as e:
        raise CommandRefused(str(e)) from None


# -- run state --------------------------------------------------------------------------------------
def pause(control: Plane, cmd: Pause, reply: Reply) -> Move:
    """Ask the loop to hold at this boundary (Trainer._act pauses the control plane)."""
    trainer = control.trainer
    if control.ended:
        raise CommandRefused("pause: training has ended; there is nothing left to pause")
    return Move(Signal(pause=True), lambda _: {"state": RunState.PAUSED.value, "step": trainer.state.global_step},
                "pause")


def resume(control: Plane, cmd: Resume, reply: Reply) -> dict:
    trainer = control.trainer
    if trainer.config.control.chat_only:
        raise CommandRefused("resume: this is a chat-only run (control.chat_only): it holds the model "
                             "for chat and trains nothing; start a run to train")
    control.resume()
    return {"state": RunState.RUNNING.value, "step": trainer.state.global_step}


def stop(control: Plane, cmd: Stop, reply: Reply) -> Move:
    """Stop after this boundary. `save` (default true, contract.protocol.Stop): a training
    checkpoint now and the final model when the run ends; false: nothing is written, neither
    these nor the schedule's end-of-training checkpoint (whatever checkpoint.save_at_end says). A save that fails (every rank alike, engine.checkpoint.atomic)
    does not keep the run going: it stops without the final model either, the reply's
    `save_error` says why, and the newest complete checkpoint is where to resume."""
    trainer = control.trainer
    path, error = None, None
    if cmd.save and not trainer.config.control.chat_only:  # a chat-only run has nothing new to save
        try:
            path = control.save_checkpoint()
        except CheckpointError as e:  # a stop must stop (a closed terminal sends one, too)
            error = str(e)
    final = cmd.save and error is None and not trainer.config.control.chat_only
    control.settings.final_save = final
    control.stop()  # the run says it is stopping, and a pause ends; the loop ends it (Trainer._act)
    result = {"state": RunState.STOPPING.value, "step": trainer.state.global_step, "checkpoint": path,
              "final_model": final}
    return Move(Signal(stop=True, reason="stop"),
                lambda _: result if error is None else {**result, "save_error": error}, "stop")


def save(control: Plane, cmd: Save, reply: Reply) -> dict:
    return {"checkpoint": control.save_checkpoint(), "step": control.trainer.state.global_step}


def evaluate(control: Plane, cmd: Evaluate, reply: Reply) -> dict | Move:
    """Evaluate now; what the evaluation's hooks ask of the loop (early stopping's stop) goes to
    the loop like a command's move."""
    trainer = control.trainer
    if trainer.eval_dataset is None:
        raise CommandRefused("evaluate: this run has no evaluation data (data.eval is empty)")
    metrics, asked = trainer.evaluation()
    result = {"step": trainer.state.global_step, "metrics": metrics}
    return result if asked == NOTHING else Move(asked, lambda _: result, "evaluate")


# -- live settings --------------------------------------------------------------------------------
def set_values(control: Plane, cmd: Set, reply: Reply) -> dict:
    """Check every change first, then apply them all (all or nothing), record them as an event."""
    trainer, live = control.trainer, control.settings
    _check_settable(control, cmd)
    before = current_settings(control)
    if cmd.lr is not None:
        old = trainer.current_lr()
        trainer.set_lr(cmd.lr)
        base = trainer.config.optim.lr
        live.lr_scale = live.lr_scale * cmd.lr / old if old > 0 else (cmd.lr / base if base > 0 else 1.0)
    if cmd.lr_scale is not None:
        trainer.scale_lr(cmd.lr_scale / live.lr_scale)
        live.lr_scale = cmd.lr_scale
    for key in REPLACED:
        if getattr(cmd, key) is not None:
            setattr(live, key, getattr(cmd, key))
    if cmd.generation is not None:
        live.generation.update(cmd.generation.sampling())
    live_fields.record(trainer, live, cmd)
    apply_settings(control)
    after = current_settings(control)
    names = list(cmd.args())
    changes = {k: after[k] for k in names}
    # set between steps: `lr` is the rate the next step trains with (train records log each
    # step's own rate), so the change applies from step + 1
    applies = trainer.state.global_step + 1
    trainer.emit(SetEvent(step=trainer.state.global_step, changes=changes,
                          before={k: before[k] for k in names}, applies_from_step=applies))
    return {"step": trainer.state.global_step, "changes": changes, "applies_from_step": applies}


def _check_settable(control: Plane, cmd: Set) -> None:
    trainer = control.trainer
    # trainer.optimizer: the engine's, or the fused LOMO one the engine does not know about
    if (cmd.lr is not None or cmd.lr_scale is not None) and getattr(trainer, "optimizer", None) is None:
        raise CommandRefused("set: this run has no optimizer whose learning rate could change")
    if cmd.lr_scale is not None and control.settings.lr_scale == 0:
        raise CommandRefused("set: the learning rate is 0, so it cannot be scaled; set `lr` instead")
    zero = trainer.ds_setup.config.get("zero_optimization", {})  # the run's DeepSpeed config, as built
    if (cmd.grad_clip or 0) > 0 and zero.get("compute_grad_norm", True) is False:
        raise CommandRefused("set: grad_clip needs zero_optimization.compute_grad_norm=true")
    if (cmd.eval_every_n_steps or 0) > 0 and trainer.eval_dataset is None:
        raise CommandRefused("set: eval_every_n_steps needs evaluation data, and this run has none")
    problem = live_fields.problem(trainer, control.settings, cmd)
    if problem:
        raise CommandRefused(problem)


def apply_settings(control: Plane) -> None:
    """Put the kept settings that live in the engine into it (after `set`, on resume, and on a
    rewind, engine.checkpoint.rewind). A setting `set` has not changed (None) is the run's own:
    a rewind to a state from before a `set grad_clip` puts the run's clipping back."""
    trainer = control.trainer
    clip = control.settings.grad_clip
    if clip is None:  # the DeepSpeed config the engine was built from has the run's value
        clip = trainer.ds_setup.config.get("gradient_clipping", trainer.config.optim.grad_clip)
    if trainer.method.grad_clip(trainer.ctx) != float(clip):  # the method knows who clips (LOMO: itself)
        trainer.method.set_grad_clip(trainer.ctx, float(clip))
    live_fields.apply(trainer, control.settings, getattr(control, "serving", None))


def current_settings(control: Plane) -> dict:
    trainer, live = control.trainer, control.settings
    return {"lr": trainer.current_lr(), "lr_scale": live.lr_scale,
            "grad_clip": trainer.method.grad_clip(trainer.ctx),
            "eval_every_n_steps": live.eval_every(trainer.config),
            "save_every_n_steps": live.save_every(trainer.config),
            "generation": live.generation_params(), **live_fields.current(trainer, control.serving)}


def rewards(control: Plane, cmd: AddReward | RemoveReward, reply: Reply) -> dict:
    """A GRPO run's reward functions changed (engine.objectives.grpo_live), recorded as a `set`
    event of `rewards` (the entries before and after), kept in the checkpoints."""
    trainer = control.trainer
    try:
        if isinstance(cmd, AddReward):
            before = grpo_live.add(trainer, control.settings, cmd, control.world_size)
        else:
            before = grpo_live.remove(trainer, control.settings, cmd)
    except grpo_live.RewardRefused as e:
        raise CommandRefused(str(e)) from None
    after = grpo_live.current(trainer)["rewards"]
    step = trainer.state.global_step
    trainer.emit(SetEvent(step=step, changes={"rewards": after}, before={"rewards": before},
                          applies_from_step=step + 1))
    return {"step": step, "rewards": after, "applies_from_step": step + 1}


# -- rewind, branch, snapshot (engine.checkpoint.rewind) ------------------------------------------------
def _not_ended(control: Plane, what: str) -> None:
    """Refused from the end's first boundary on: the final weights are the run's (the final
    model is saved after these boundaries)."""
    if control.finishing or control.ended:
        raise CommandRefused(f"{what}: training has ended; start a new run with resume= instead")


def rewind(control: Plane, cmd: Rewind, reply: Reply) -> Move:
    """Ask the loop to load the target into the running engines on every rank (Trainer._act);
    training goes on from there. Refused there, alike on every rank, before anything changed."""
    _not_ended(control, "rewind")
    return Move(Signal(rewind=cmd.target), lambda result: result.event().record(), "rewind")


def branch(control: Plane, cmd: Branch, reply: Reply) -> Move:
    """Ask the loop to rewind and go on as a new branch; then the command's settings are applied
    as a `set`."""
    _not_ended(control, "branch")
    changes = cmd.settings()
    if changes:  # checked before anything moves: a refused setting refuses the branch
        _check_settable(control, Set(**changes))

    def answer(result: Any) -> dict:
        out = result.event(BranchEvent).record()
        if changes:
            out["set"] = set_values(control, Set(**changes), reply)
        return out
    return Move(Signal(rewind=cmd.target, branch=cmd.branch, settings=changes), answer, "branch")


def snapshot(control: Plane, cmd: Snapshot, reply: Reply) -> dict:
    try:
        return rewinding.take_snapshot(control.trainer, cmd.snapshot)
    except CheckpointError as e:
        raise CommandRefused(str(e)) from None


def branches(control: Plane, cmd: Branches, reply: Reply) -> dict:
    trainer = control.trainer
    tree = rewinding.tree_of(trainer)
    store = rewinding.snapshot_store(trainer)
    return {"current": rewinding.current_branch(trainer), "step": trainer.state.global_step,
            "tree": tree.to_dict()["branches"], **rewinding.available(trainer),
            "snapshot_details": [{"name": s.name, "step": s.step, "branch": s.branch, "bytes": s.bytes}
                                 for s in store.snapshots]}


# -- status -----------------------------------------------------------------------------------------
def status(control: Plane, cmd: Status, reply: Reply) -> StatusAnswer:
    """Queued `status` with `ranks`: every rank's memory, gathered here (collective)."""
    mine = memory_mb()
    everyone: list[Any] = [mine]
    if control.world_size > 1:
        everyone = [None] * control.world_size
        dist.all_gather_object(everyone, mine)
    return control.status_snapshot().model_copy(update={
        "memory_mb": {str(r): m for r, m in enumerate(everyone)}, "memory_of": "every rank"})


def memory_mb() -> dict[str, float]:
    """This process's memory: the GPU's allocated and peak where there is one, and the RSS."""
    mem = {"rss": psutil.Process(os.getpid()).memory_info().rss / 2**20}
    if torch.cuda.is_available():
        mem.update(allocated=torch.cuda.memory_allocated() / 2**20,
                   peak=torch.cuda.max_memory_allocated() / 2**20)
    return mem


# -- data commands (engine.control.data_commands) ---------------------------------------------------
def _data(handler: Callable[..., dict]) -> Handler:
    """A data command's handler, its refusals as CommandRefused."""
    def run(control: Plane, cmd: Any, reply: Reply) -> dict:
        try:
            if isinstance(cmd, Teach):
                return handler(control, cmd, reply, prompt_text(control.trainer.tokenizer, cmd))
            return handler(control, cmd, reply)
        except data_commands.DataRefused as e:
            raise CommandRefused(str(e)) from None
    return run


# -- a GRPO run's ratings (engine.objectives.grpo_samples) -------------------------------------------
def rate(control: Plane, cmd: Rate, reply: Reply) -> dict:
    """Rate a kept sample of a GRPO run (in the inbox before the answer); any other run refuses."""
    ratings = grpo_samples.ratings_of(control.trainer)
    if ratings is None:
        raise CommandRefused("rate: only a GRPO run's samples can be rated (preference.objective=grpo)")
    try:
        return ratings.rate(control.trainer, cmd, control.rank, lambda v: data_commands._from_rank0(control, v))
    except grpo_samples.RatingRefused as e:
        raise CommandRefused(str(e)) from None


def rate_chat(control: Plane, cmd: RateChat, reply: Reply) -> dict:
    """Rate an answer the chat gave with this GRPO run's live weights (engine.objectives.grpo_chat):
    in the inbox before the answer; the next step samples the rest of its group."""
    trainer = control.trainer
    ratings = grpo_samples.ratings_of(trainer)
    if ratings is None or trainer.config.control.chat_only:
        what = "a chat-only run (it trains nothing)" if trainer.config.control.chat_only else \
            f"a {trainer.config.preference.objective} run"
        raise CommandRefused(f"rate_chat: only a GRPO run's chat answers can be rated (preference.objective=grpo); "
                             f"this is {what}")
    return grpo_chat.rate(ratings, trainer, cmd, prompt_text(trainer.tokenizer, cmd), control.rank,
                          lambda v: data_commands._from_rank0(control, v), CommandRefused)


def forget(control: Plane, cmd: Forget, reply: Reply) -> dict:
    """Forget a rating (a GRPO run's), else a taught entry (data_commands.forget)."""
    ratings = grpo_samples.ratings_of(control.trainer)
    if ratings is not None:
        try:
            answer = ratings.forget(control.trainer, cmd, control.rank, lambda v: data_commands._from_rank0(control, v))
        except grpo_samples.RatingRefused as e:
            raise CommandRefused(str(e)) from None
        if answer is not None:
            return answer
    return _data(data_commands.forget)(control, cmd, reply)


DATA_HANDLERS: dict[type[Command], Handler] = {
    AddSource: _data(data_commands.add_source), SetWeight: _data(data_commands.set_weight),
    RemoveSource: _data(data_commands.remove_source), Teach: _data(data_commands.teach),
    Inbox: _data(data_commands.inbox), Forget: forget, Rate: rate, RateChat: rate_chat}


# one handler per command type (the model class, not its name, picks it)
HANDLERS: dict[type[Command], Handler] = {
    Generate: generate, Complete: complete, Pause: pause, Resume: resume, Stop: stop, Save: save,
    Evaluate: evaluate, Set: set_values, Status: status,
    Rewind: rewind, Branch: branch, Snapshot: snapshot, Branches: branches,
    **DATA_HANDLERS, AddReward: rewards, RemoveReward: rewards,
}
