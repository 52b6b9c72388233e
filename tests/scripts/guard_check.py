"""The spike guard meets injected trouble, two scenarios one after the other in one launch
(2 ranks, the tiny model of ckpt_common, micro-batch 4, one micro-batch per step):

    skip    LoRA, ZeRO 2, on rows of one easy text (the model soon predicts it with
            confidence): the micro-batches of steps 7 and 8 are replaced by random tokens on
            both ranks. Step 7 is skipped before its backward; step 8 would be the second skip
            in a row (guard.max_skips_in_a_row 1), so the guard pauses; a `resume` queued by
            the driver just before lets the run go on.
    rewind  full, ZeRO 0: after step 6 a live `set lr=1.0` (far too high) is queued through the
            control plane; step 7 trains with it, step 8's loss spikes, and the guard rewinds
            to its snapshot of step 6 (guard.snapshot_every_n_steps 2) with the lr halved.
    accum   full, ZeRO 2, two micro-batches per step: the same `set lr`, but the guard can only
            judge after the update; it rewinds to the checkpoint step-6 on disk.

Prints per rank the (step, loss) sequence, the gradient norms the guard read, DeepSpeed's count
of applied optimizer steps and the run folder. Not a test module (tests/test_spike_guard.py runs it)."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckpt_common import make_task, overrides, report  # noqa: E402

GUARD = ["guard.enabled=true", "guard.warmup_steps=4", "guard.window=6", "control.enabled=true",
         "train.grad_accum=1", "max_steps=12", "optim.warmup_steps=1"]
SCENARIOS = {
    "skip": (2, ["method=lora", "lr=1e-1", "guard.on_spike=skip", "guard.max_skips_in_a_row=1"]),
    "rewind": (0, ["lr=3e-3", "guard.on_spike=rewind", "guard.snapshot_every_n_steps=2"]),
    "accum": (2, ["lr=3e-3", "train.grad_accum=2", "guard.on_nonfinite=rewind", "guard.on_spike=rewind",
                  "checkpoint.every_n_steps=3"]),
}
POISONED = {7, 8}      # skip: the steps (counted as trained) whose batches are random tokens
TOO_HIGH = (6, 1.0)    # rewind: after this many steps, set this lr


def poison(micro_batches: list[dict], vocab: int, seed: int) -> None:
    """Replace each micro-batch's tokens by random ones (in place; labels follow, padding stays)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    for batch in micro_batches:
        ids = torch.randint(3, vocab, batch["input_ids"].shape, generator=gen)
        labels = batch["labels"]
        batch["labels"] = torch.where(labels == -100, labels, ids)
        batch["input_ids"] = torch.where(labels == -100, batch["input_ids"], ids)


def repeated_rows(root: Path, rows: int = 48) -> str:
    """A training file of one easy row (a letter repeated), `rows` times: a tiny model soon
    predicts it with confidence, so random tokens are a loss spike even after a few steps."""
    path = root / "repeated.jsonl"
    path.write_text("".join(json.dumps({"text": "ab" * 20}) + "\n" for _ in range(rows)))
    return str(path)


def run(name: str, task: dict, out: Path, zero_stage: int | None = None) -> dict:
    from contract.config.load import load_config
    from contract.protocol.commands import Resume, Set
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.guard.hook import GuardCallback
    from engine.trainer import Trainer

    zero, extra = SCENARIOS[name]
    zero = zero if zero_stage is None else zero_stage
    if name == "skip":
        task = {**task, "train": repeated_rows(out / "task")}
    cfg = load_config(overrides=overrides(task, str(out / "runs"), name, zero, [*GUARD, *extra]))
    seen: list[list] = []
    norms: list = []  # the gradient norm the guard reads after each step

    def queue(trainer, cmd) -> None:
        if trainer.env.rank == 0:
            req = f"driver-{len(seen)}-{cmd.name}"
            trainer.control.commands.put(req, cmd, Reply(req, None))

    class Driver(Callback):
        def on_train_batch_begin(self, trainer, micro_batches):
            if name == "skip" and len(seen) + 1 in POISONED:
                vocab = len(trainer.tokenizer)  # (under ZeRO 3 the embedding is partitioned)
                poison(micro_batches, vocab, seed=1000 * trainer.env.rank + len(seen))

        def on_train_batch_end(self, trainer, loss):
            seen.append([trainer.state.global_step, loss])
            guard = next(cb for cb in trainer.callbacks if isinstance(cb, GuardCallback))
            norms.append(guard._grad_norm(trainer))  # the norm the guard reads after this step
            if name == "skip" and len(seen) == max(POISONED):
                queue(trainer, Resume())  # before the guard's pause: executed at this boundary
            if name in ("rewind", "accum") and len(seen) == TOO_HIGH[0]:
                queue(trainer, Set(lr=TOO_HIGH[1]))

    trainer = Trainer(config=cfg, callbacks=[Driver()])
    trainer.train()
    result = {"scenario": name, "rank": trainer.env.rank, "seen": seen, "folder": str(trainer.folder.root),
              "optimizer_steps": int(trainer.engine.global_steps), "paused": trainer.control.paused, "norms": norms}
    trainer.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenarios", default="skip,rewind,accum")
    p.add_argument("--out", required=True)
    p.add_argument("--zero", type=int, default=None, help="another ZeRO stage for every scenario (by hand)")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    task = make_task(out / "task")
    for name in a.scenarios.split(","):
        report(**run(name, task, out, a.zero))


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
