"""The command handlers, run at a step boundary by every rank in the same order.

A handler gets the control plane, the command's (already validated) arguments and the reply to
its sender (a silent one on ranks other than 0) and returns the result sent back as `done`.
It raises :class:`CommandRefused` when the command cannot apply in the run's present state;
every rank refuses alike, because every rank sees the same state and arguments, so collective
work is never entered by some ranks only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import psutil
import torch
import torch.distributed as dist

from engine.control.pending import Reply
from engine.generation import generate as generate_text
from contract.protocol import GENERATION_PARAMS

if TYPE_CHECKING:
    from engine.control.plane import Control

# what a chat request gets when neither it nor `set generation` says otherwise
GENERATION_DEFAULTS: dict[str, Any] = {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0,
                                       "top_k": 0, "repetition_penalty": 1.0, "seed": 0, "stop": []}


class CommandRefused(RuntimeError):
    """The command does not apply now (same on every rank); nothing was changed."""


Handler = Callable[["Control", dict, Reply], dict]


# -- generate -------------------------------------------------------------------------------------
def generate(control: "Control", args: dict, reply: Reply) -> dict:
    trainer = control.trainer
    params = {**GENERATION_DEFAULTS, **control.settings["generation"],
              **{k: v for k, v in args.items() if k in GENERATION_PARAMS}}
    prompt = prompt_text(trainer.tokenizer, args)
    step = trainer.state.global_step
    streams = control.rank == 0
    text = generate_text(trainer, [prompt], **params,
                         on_text=(lambda t: reply.token(t, "current")) if streams else None)[0]
    result: dict[str, Any] = {"text": text, "step": step, "model": "current"}
    if args.get("compare_base"):
        if has_adapter(trainer):
            result["base"] = generate_text(trainer, [prompt], **params, use_base=True,
                                           on_text=(lambda t: reply.token(t, "base")) if streams else None)[0]
        else:
            result["base"] = None
            result["note"] = "no PEFT adapter is training, so there is no separate base model to compare"
    return result


def has_adapter(trainer) -> bool:
    return hasattr(trainer.engine.module, "disable_adapter") and hasattr(trainer.engine.module, "peft_config")


def prompt_text(tokenizer, args: dict) -> str:
    """The text the model continues: the chat template applied to `messages`, or `prompt` with
    the BOS token the tokenizer puts in front of every training sample."""
    if "messages" in args:
        if not getattr(tokenizer, "chat_template", None):
            raise CommandRefused("generate: this model's tokenizer has no chat template; send `prompt`")
        return tokenizer.apply_chat_template(args["messages"], tokenize=False, add_generation_prompt=True)
    prompt = args["prompt"]
    bos = tokenizer.bos_token
    if bos and _adds_bos(tokenizer) and not prompt.startswith(bos):
        prompt = bos + prompt
    if not prompt:
        raise CommandRefused("generate: the prompt is empty")
    return prompt


def _adds_bos(tokenizer) -> bool:
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bool(with_special) and with_special[0] == tokenizer.bos_token_id


# -- run state --------------------------------------------------------------------------------------
def pause(control: "Control", args: dict, reply: Reply) -> dict:
    trainer = control.trainer
    if control.ended:
        raise CommandRefused("pause: training has ended; there is nothing left to pause")
    if not trainer.paused:
        trainer.paused = True
        control.emit_state("paused")
    return {"state": "paused", "step": trainer.state.global_step}


def resume(control: "Control", args: dict, reply: Reply) -> dict:
    trainer = control.trainer
    if trainer.paused:
        trainer.paused = False
        control.emit_state("running")
    return {"state": "running", "step": trainer.state.global_step}


def stop(control: "Control", args: dict, reply: Reply) -> dict:
    """Stop after this boundary. `save` (default true): a training checkpoint now and the final
    model when the run ends; false: neither (whatever checkpoint.save_at_end says)."""
    trainer, save = control.trainer, args.get("save", True)
    path = control.save_checkpoint() if save else None  # a failed save fails the stop: nothing lost
    control.emit_state("stopping")
    trainer.config.checkpoint.save_at_end = save
    trainer.should_stop, trainer.paused = True, False
    return {"state": "stopping", "step": trainer.state.global_step, "checkpoint": path,
            "final_model": save}


def save(control: "Control", args: dict, reply: Reply) -> dict:
    return {"checkpoint": control.save_checkpoint(), "step": control.trainer.state.global_step}


def evaluate(control: "Control", args: dict, reply: Reply) -> dict:
    trainer = control.trainer
    if trainer.eval_dataset is None:
        raise CommandRefused("evaluate: this run has no evaluation data (data.eval is empty)")
    return {"step": trainer.state.global_step, "metrics": trainer.evaluate()}


# -- live settings --------------------------------------------------------------------------------
def set_values(control: "Control", args: dict, reply: Reply) -> dict:
    """Check every change first, then apply them all (all or nothing), record them as an event."""
    trainer, settings = control.trainer, control.settings
    _check_settable(control, args)
    before = current_settings(control)
    if "lr" in args:
        old = trainer.current_lr()
        trainer.set_lr(float(args["lr"]))
        base = trainer.config.optim.lr
        settings["lr_scale"] = settings["lr_scale"] * args["lr"] / old if old > 0 else \
            (args["lr"] / base if base > 0 else 1.0)
    if "lr_scale" in args:
        trainer.scale_lr(args["lr_scale"] / settings["lr_scale"])
        settings["lr_scale"] = float(args["lr_scale"])
    for key in ("grad_clip", "eval_every_n_steps", "save_every_n_steps"):
        if key in args:
            settings[key] = args[key]
    settings["generation"].update(args.get("generation", {}))
    apply_settings(control)
    after = current_settings(control)
    changes = {k: after[k] for k in args}
    trainer.emit({"type": "set", "step": trainer.state.global_step, "changes": changes,
                  "before": {k: before[k] for k in args}})
    return {"step": trainer.state.global_step, "changes": changes}


def _check_settable(control: "Control", args: dict) -> None:
    trainer = control.trainer
    # trainer.optimizer: the engine's, or the fused LOMO one the engine does not know about
    if ("lr" in args or "lr_scale" in args) and getattr(trainer, "optimizer", None) is None:
        raise CommandRefused("set: this run has no optimizer whose learning rate could change")
    if "lr_scale" in args and control.settings["lr_scale"] == 0:
        raise CommandRefused("set: the learning rate is 0, so it cannot be scaled; set `lr` instead")
    if args.get("grad_clip", 0) > 0 and getattr(trainer.engine.optimizer, "compute_grad_norm", True) is False:
        raise CommandRefused("set: grad_clip needs zero_optimization.compute_grad_norm=true")
    if args.get("eval_every_n_steps", 0) > 0 and trainer.eval_dataset is None:
        raise CommandRefused("set: eval_every_n_steps needs evaluation data, and this run has none")


def apply_settings(control: "Control") -> None:
    """Put the kept settings into the engine and the config the loop reads (also on resume)."""
    trainer, settings = control.trainer, control.settings
    if "grad_clip" in settings:
        set_grad_clip(trainer.engine, float(settings["grad_clip"]))
    if "eval_every_n_steps" in settings:
        trainer.config.eval.every_n_steps = settings["eval_every_n_steps"]
    if "save_every_n_steps" in settings:
        trainer.config.checkpoint.every_n_steps = settings["save_every_n_steps"]


def set_grad_clip(engine, value: float) -> None:
    """DeepSpeed reads the clip value from its config (ZeRO 0) or its optimizer wrapper (ZeRO,
    bf16 / fp16 wrappers), both set once at start; change both."""
    engine._config.gradient_clipping = value
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = value


def current_settings(control: "Control") -> dict:
    trainer = control.trainer
    return {"lr": trainer.current_lr(), "lr_scale": control.settings["lr_scale"],
            "grad_clip": float(trainer.engine.gradient_clipping() or 0.0),
            "eval_every_n_steps": trainer.config.eval.every_n_steps,
            "save_every_n_steps": trainer.config.checkpoint.every_n_steps,
            "generation": {**GENERATION_DEFAULTS, **control.settings["generation"]}}


# -- status -----------------------------------------------------------------------------------------
def status(control: "Control", args: dict, reply: Reply) -> dict:
    """Queued `status` with `ranks`: every rank's memory, gathered here (collective)."""
    mine = memory_mb()
    everyone = [mine]
    if control.world_size > 1:
        everyone = [None] * control.world_size
        dist.all_gather_object(everyone, mine)
    return {**control.status_snapshot(), "memory_mb": {str(r): m for r, m in enumerate(everyone)},
            "memory_of": "every rank"}


def memory_mb() -> dict[str, float]:
    """This process's memory: the GPU's allocated and peak where there is one, and the RSS."""
    mem = {"rss": psutil.Process(os.getpid()).memory_info().rss / 2**20}
    if torch.cuda.is_available():
        mem.update(allocated=torch.cuda.memory_allocated() / 2**20,
                   peak=torch.cuda.max_memory_allocated() / 2**20)
    return mem


HANDLERS: dict[str, Handler] = {
    "generate": generate, "pause": pause, "resume": resume, "stop": stop, "save": save,
    "evaluate": evaluate, "set": set_values, "status": status,
}
