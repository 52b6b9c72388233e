"""What a launched run adds around the Trainer: control plane, checkpoint schedule, final save."""

from __future__ import annotations

from contract.config import RunConfig


def callbacks_of(cfg: RunConfig) -> list:
    callbacks = []
    try:
        from engine.checkpoint import checkpoint_callbacks
        callbacks += checkpoint_callbacks(cfg)
    except ImportError:
        pass
    if cfg.control.enabled:  # last: a boundary's commands see the step's scheduled work done
        from engine.control import ControlCallback
        callbacks.append(ControlCallback())
    return callbacks


def resume_if_asked(trainer) -> None:
    if not trainer.config.resume:
        return
    from engine.checkpoint import resolve_resume
    trainer.load_checkpoint(resolve_resume(trainer.config.resume, trainer.folder))


def finish(trainer) -> None:
    if trainer.config.checkpoint.save_at_end and hasattr(trainer, "save_model"):
        trainer.save_model(str(trainer.folder.model))


def shut_down(trainer) -> None:
    control = getattr(trainer, "control", None)
    if control is not None:
        control.close()
    trainer.close()
