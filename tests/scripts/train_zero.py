"""Train the default task with our Trainer on the launcher's ranks, once per ZeRO stage asked for
(one Trainer after the other in the same process group: one launch instead of one per stage);
report each stage's losses and how many parameter elements this rank holds."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    for zero in a.zero:
        train(zero, str(Path(a.out) / f"zero{zero}"))


def train(zero: int, out: str) -> None:
    """Train one Trainer under ZeRO `zero` and report what the test checks."""
    from engine.callbacks import Callback
    from contract.config.load import load_config
    from engine.trainer import Trainer

    cfg = load_config(overrides=[f"zero_stage={zero}", "nproc=2", "max_steps=40", "lr=3e-3",
                                 "batch_size=16", "data.max_length=32", "optim.warmup_steps=5",
                                 "eval.at_end=false", "checkpoint.save_at_end=false",
                                 "control.enabled=false", f"output_dir={out}", "run_name=z"])
    losses = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, loss):
            losses.append(loss)

    trainer = Trainer(config=cfg, callbacks=[Record()])
    held = sum(getattr(q, "ds_tensor", q).numel() for q in trainer.engine.module.parameters())
    total = sum(getattr(q, "ds_numel", q.numel()) for q in trainer.engine.module.parameters())
    trainer.train()
    report(zero=zero, rank=trainer.env.rank, losses=losses, held=held, total=total)
    trainer.close()

if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
