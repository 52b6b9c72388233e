"""A checkpoint save that fails on rank 1 only: rank 1's write of its optimizer partition at step
2 raises PermissionError (injected: the test runs as root, where file modes do not stop a
write). Both ranks must come out of the save with the same error, at once, and train on; the
schedule's next saves must succeed. Reports the losses, the checkpoints and the events. With
`--export`, then (same launch) tests/scripts/export_disk.py's ZeRO-3 export on a full disk."""

import argparse
import errno
import json
import time
from pathlib import Path

import torch

from ckpt_common import make_task, overrides, report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--export", action="store_true", help="then export_disk's check, reported with part=export")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    save_fails_on_one_rank(a.out)
    if a.export:
        from export_disk import export_fills_the_disk
        report(part="export", **export_fills_the_disk(Path(a.out), "export-run"))


def save_fails_on_one_rank(out: str) -> None:
    """The run "run" in `out`, its step-2 save failing on rank 1; rank 0 reports (part=save)."""
    from contract.config.load import load_config
    from engine.trainer import Trainer

    task = make_task(Path(out) / "task")
    cfg = load_config(overrides=overrides(task, out, "run", 2, [
        "train.grad_accum=1", "epochs=1", "checkpoint.every_n_steps=2"]))
    trainer = Trainer(config=cfg)
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if trainer.env.rank == 1 and "global_step2" in str(f) and "optim_states" in str(f):
            raise PermissionError(errno.EACCES, "Permission denied", str(f))
        return real_save(obj, f, *args, **kwargs)

    torch.save = failing_save
    started = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - started
    torch.save = real_save
    if trainer.env.rank == 0:
        folder = trainer.folder
        events = [json.loads(line) for line in folder.events.read_text().splitlines()]
        report(part="save", rank=0, seconds=seconds, step=trainer.state.global_step, total=trainer.state.total_steps,
               listing=sorted(p.name for p in folder.checkpoints.iterdir()),
               losses={e["step"]: e["loss"] for e in events if e["type"] == "train"},
               failed=[e for e in events if e["type"] == "checkpoint_failed"],
               saved=[e["step"] for e in events if e["type"] == "checkpoint"])


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
