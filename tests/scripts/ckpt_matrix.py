"""Each layout x method cell loads its own training checkpoints exactly, at the default precision
(`precision: auto`: bf16 on a CPU that has it), one cell after another in one launch. A cell is
`name=zero:method[:tp|pp]`; its run (4 steps, step-2 saved by the schedule) is rewound to step-2
after step 4 through the control plane's real path, and a cell listed in --resume is then also
started afresh with `resume=<its step-2>` and trained to the end. Prints per rank and run the
(step, loss) sequence and the precision. Not a test module (tests/test_checkpoint_matrix.py runs it)."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckpt_common import make_task, overrides, report  # noqa: E402

METHOD_ARGS = {"full": [], "lora": ["method=lora"], "lomo": ["method=lomo", "lr=5e-2"],
               "adalomo": ["method=adalomo", "lr=1e-2"]}


def cell_args(cell: str) -> tuple[str, int, list[str]]:
    """(name, ZeRO stage, overrides) of `name=zero:method[:tp|pp]`."""
    name, spec = cell.split("=")
    zero, method, *split = spec.split(":")
    extra = [*METHOD_ARGS[method], *(f"{s}=2" for s in split)]
    return name, int(zero), extra


def train(task: dict, out: Path, name: str, zero: int, extra: list[str], rewind: bool) -> dict:
    from contract.config.load import load_config
    from contract.protocol.branch_commands import Rewind
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.trainer import Trainer

    cfg = load_config(overrides=overrides(task, str(out / "runs"), name, zero, [
        *extra, "max_steps=4", "train.grad_accum=1", "precision=auto", f"control.enabled={str(rewind).lower()}",
        "checkpoint.every_n_steps=2", "checkpoint.keep_last=0",
        *([] if rewind else [f"resume={out / 'runs' / name.removesuffix('-resumed') / 'checkpoints' / 'step-2'}"])]))
    seen: list[list] = []
    replies: list[dict] = []

    class Driver(Callback):
        def on_train_batch_end(self, trainer, loss):
            seen.append([trainer.state.global_step, loss])
            if rewind and len(seen) == 4 and trainer.env.rank == 0:
                trainer.control.commands.put("rewind", Rewind(target="2"), Reply("rewind", replies.append, Rewind.returns))

    trainer = Trainer(config=cfg, callbacks=[Driver()])
    trainer.train()
    result = {"cell": name, "rank": trainer.env.rank, "precision": trainer.precision, "seen": seen,
              "errors": [r.get("message") for r in replies if r.get("type") == "error"]}
    trainer.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cells", required=True, help="name=zero:method[:tp|pp],...")
    p.add_argument("--resume", default="", help="cells also resumed afresh from their step-2")
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    task = make_task(out / "task")
    resumed = set(a.resume.split(","))
    for cell in a.cells.split(","):
        name, zero, extra = cell_args(cell)
        report(**train(task, out, name, zero, extra, rewind=True))
        if name in resumed:
            report(**train(task, out, f"{name}-resumed", zero, extra, rewind=False))


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
