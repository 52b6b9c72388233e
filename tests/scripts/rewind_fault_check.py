"""A rewind or branch that fails in the middle of its load, through the control plane's real
path (rank 0's queue -> the boundary broadcast -> every rank's handler), at the default precision
(`precision: auto`, bf16 on a CPU that has it), per layout one run without commands and one with:

    after step 3: rewind to 2, the optimizer's load raising before it reads anything
    after step 4: branch b from step-2, the optimizer's load raising after it has loaded
    after step 5 (--lost): rewind to 4, the load failing and the undo's load failing too

The failures are injected on every rank into the optimizer's `load_state_dict`, so they strike
after DeepSpeed has begun to change the engine (model, schedule, data position). Prints per rank
both runs' (step, loss) sequences, the replies, the branches and how the run ended. Not a test
module (tests/test_rewind_faults.py runs it)."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckpt_common import make_task, overrides, report  # noqa: E402

LAYOUTS = {"zero3": (3, []), "pp2": (0, ["pp=2"]), "zero2": (2, []), "tp2": (0, ["tp=2"])}


class InjectedFault(RuntimeError):
    """The test's failure in the middle of a load."""


def arm(optimizer, mode: str) -> None:
    """Make the optimizer's next load(s) fail: "before" reading, "after" loading, or "twice"
    (this load before reading, and the next one too: the undo's)."""
    original = optimizer.load_state_dict
    left = 2 if mode == "twice" else 1

    def failing(*args, **kwargs):
        nonlocal left
        if mode == "after":
            original(*args, **kwargs)
        left -= 1
        if left == 0:
            optimizer.load_state_dict = original
        raise InjectedFault(f"injected failure ({mode} the optimizer's load)")

    optimizer.load_state_dict = failing


def run(name: str, task: dict, out: Path, faults: bool, lost: bool) -> dict:
    from contract.config.load import load_config
    from contract.protocol.branch_commands import Branch, Rewind
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.trainer import Trainer

    zero, extra = LAYOUTS[name]
    run_name = f"{name}-{'faults' if faults else 'plain'}"
    cfg = load_config(overrides=overrides(task, str(out / "runs"), run_name, zero, [
        *extra, "max_steps=6", "train.grad_accum=1", "precision=auto", "control.enabled=true",
        "checkpoint.every_n_steps=2"]))
    plan = {3: ("before", Rewind(target="2")), 4: ("after", Branch(target="step-2", branch="b"))}
    if lost:
        plan[5] = ("twice", Rewind(target="4"))
    seen: list[list] = []
    replies: list[dict] = []

    class Driver(Callback):
        def on_train_batch_end(self, trainer, loss):
            step = trainer.state.global_step
            seen.append([step, loss])
            if not faults or step not in plan or len(seen) != step:
                return
            mode, cmd = plan[step]
            arm(trainer.engine.optimizer, mode)  # every rank: the command runs on every rank
            if trainer.env.rank == 0:
                req = f"{step}-{cmd.name}"
                trainer.control.commands.put(req, cmd, Reply(req, replies.append, cmd.returns))

    trainer = Trainer(config=cfg, callbacks=[Driver()])
    ended = None
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - what the worker would record as the run's end
        ended = f"{type(e).__name__}: {e}"
    result = {"layout": name, "faults": faults, "rank": trainer.env.rank, "precision": trainer.precision,
              "seen": seen, "ended": ended, "branch": trainer.folder.branch,
              "replies": [{"id": r["id"], "error": r.get("message")} for r in replies
                          if r.get("type") in ("done", "error")],
              "folder": str(trainer.folder.root)}
    trainer.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True)
    p.add_argument("--lost", default="", help="layouts whose run ends with a failed undo")
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    task = make_task(out / "task")
    for name in a.layouts.split(","):
        report(**run(name, task, out, faults=False, lost=False))
        report(**run(name, task, out, faults=True, lost=name in a.lost.split(",")))


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
