"""Train on the launcher's ranks with a checkpoint every 2 steps; the save of step 4 stops for
good after DeepSpeed's first file on each rank (and says so with a flag file), so that the test
can kill the whole group in the middle of writing a checkpoint."""

import argparse
import time
from pathlib import Path

import torch

from ckpt_common import make_task, overrides


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    from contract.config.load import load_config
    from engine.trainer import Trainer

    task = make_task(Path(a.out) / "task")
    cfg = load_config(overrides=overrides(task, a.out, "run", 2, [
        "train.grad_accum=1", "epochs=1", "checkpoint.every_n_steps=2"]))
    trainer = Trainer(config=cfg)  # the config's checkpoint schedule is part of every run
    real_save = torch.save

    def stalling_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if "global_step4" in str(f):
            (Path(a.out) / f"stalled-rank{trainer.env.rank}").touch()
            time.sleep(3600)

    torch.save = stalling_save
    trainer.train()


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
