"""A plain user script: `Trainer(config=load_config(...)).train()` and nothing else, on the
launcher's ranks. The run config alone asks for the checkpoint schedule, the control plane, a
resume (`--resume latest`) and the final save; the test checks that the script got them all."""

import argparse
from pathlib import Path

from ckpt_common import make_task, overrides


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    from contract.config.load import load_config
    from engine import Trainer

    task = make_task(Path(a.out) / "task", dropout=0.0)
    cfg = load_config(overrides=overrides(task, a.out, "script", 2, [
        f"train.max_steps={a.max_steps}", "checkpoint.every_n_steps=2", "checkpoint.save_at_end=true",
        "control.enabled=true", f"resume={a.resume}"]))
    trainer = Trainer(config=cfg)
    trainer.train()
    trainer.close()


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
