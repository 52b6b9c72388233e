"""Exact resume on the launcher's ranks: train 9 steps (3 epochs) saving on a schedule, then
resume in new Trainers from a mid-epoch and an epoch-end checkpoint and train to the end; report
every run's per-step losses. Under ZeRO-3 also export the model (with reference logits for the
test to compare) and load it back; under ZeRO-2 also a sharded export and the best-model reload.

`--zero 0 2 3` does it for each stage in turn, in this one process group (one launch instead of
one per stage), each in its own folder `OUT/zeroN`."""

import argparse
from pathlib import Path

import torch

from ckpt_common import make_task, overrides, report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, nargs="+", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    for zero in a.zero:
        run_stage(zero, str(Path(a.out) / f"zero{zero}"))


def run_stage(zero: int, out: str) -> None:
    """Train, check the exports and resume twice under ZeRO `zero`, in `out`; report it all."""
    from engine import checkpoint as ck
    from engine.callbacks import Callback
    from contract.config.load import load_config
    from engine.trainer import Trainer

    task = make_task(Path(out) / "task")
    extra = ["checkpoint.every_n_steps=4", "checkpoint.every_n_epochs=1", "eval.every_n_steps=2",
             "checkpoint.keep_best=1", "checkpoint.monitor=eval/loss"]
    cfg = load_config(overrides=overrides(task, out, "run", zero, extra))
    losses: list[float] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, loss):
            losses.append(loss)

    trainer = Trainer(config=cfg, callbacks=[Record()])  # the schedule comes from the config
    trainer.train()
    full, rank = list(losses), trainer.env.rank
    names = sorted(c["name"] for c in ck.list_checkpoints(str(trainer.folder.checkpoints)))
    results = {"full": full, "checkpoints": names}
    if zero == 3:
        results.update(export_and_reload(trainer, out))
    if zero == 2:
        results.update(sharded_and_best(trainer, out, ck))
    trainer.close()

    for start in ("step-4", "step-6"):
        losses.clear()
        # no schedule in the resumed runs: they must not write over the checkpoints they start from
        quiet = load_config(overrides=overrides(task, out, "run", zero, extra + [
            "checkpoint.every_n_steps=0", "checkpoint.every_n_epochs=0"]))
        resumed = Trainer(config=quiet, run_dir=str(trainer.folder.root), callbacks=[Record()])
        resumed.load_checkpoint(str(trainer.folder.checkpoints / start))
        position = resumed.state.to_dict()
        resumed.train()
        results[start] = {"losses": list(losses), "position": position}
        resumed.close()
    report(zero=zero, rank=rank, **results)


def export_and_reload(trainer, out: str) -> dict:
    """save_model under ZeRO-3, reference logits of the engine, and load_model back."""
    batch = next(iter(trainer.train_loader(0)))
    ids = batch["input_ids"][:2]
    trainer.engine.eval()
    with torch.no_grad():
        ref = trainer.engine(input_ids=ids).logits
    trainer.save_model(f"{out}/export")
    if trainer.env.rank == 0:
        torch.save({"ids": ids, "logits": ref}, f"{out}/reference.pt")
    with torch.no_grad():  # scramble the weights, then load the export back
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        for p in trainer.engine.module.parameters():
            with GatheredParameters([p], modifier_rank=0):
                p.data.mul_(0.5)
        changed = (trainer.engine(input_ids=ids).logits - ref).abs().max().item()
    trainer.load_model(f"{out}/export")
    with torch.no_grad():
        back = (trainer.engine(input_ids=ids).logits - ref).abs().max().item()
    trainer.engine.train()
    return {"scrambled_diff": changed, "reloaded_diff": back}


def sharded_and_best(trainer, out: str, ck) -> dict:
    """A sharded export (several files + index) loads back; the best checkpoint's weights reload."""
    from engine.checkpoint.schedule import best_checkpoint
    info = ck.save_model(trainer, f"{out}/sharded", max_shard_size=150_000)
    ids = next(iter(trainer.train_loader(0)))["input_ids"][:2]
    trainer.engine.eval()
    with torch.no_grad():
        ref = trainer.engine(input_ids=ids).logits
        trainer.load_model(f"{out}/sharded")
        back = (trainer.engine(input_ids=ids).logits - ref).abs().max().item()
        c = trainer.config.checkpoint
        best = best_checkpoint(ck.list_checkpoints(str(trainer.folder.checkpoints)), c.monitor, c.mode)
        ck.load_best(trainer)
        best_loss = trainer.evaluate()["loss"]
    trainer.engine.train()
    return {"shards": info["shards"], "sharded_diff": back, "best": best["name"],
            "best_recorded": best["metrics"]["eval/loss"], "best_reloaded": best_loss}


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
