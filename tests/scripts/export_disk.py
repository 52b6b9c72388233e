"""A model export under ZeRO-3 whose write fails on rank 0 in the middle of a shard (a full disk,
injected: ENOSPC after the first tensor). Under ZeRO-3 every tensor is gathered by every rank,
so rank 0 must go on through the gathers the other rank waits in: both ranks must come out of
the export with the same DiskFullError, at once, and a second export must then succeed (the test loads it in
transformers: here, under ZeRO-3, `from_pretrained` would be collective). Reports what each rank saw."""

import argparse
import errno
import time
from pathlib import Path

from ckpt_common import make_task, overrides, report
from engine.checkpoint import locations


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    from contract.config.load import load_config
    from engine.checkpoint import atomic
    from engine import checkpoint
    from engine.checkpoint.stream_safetensors import StreamedSafetensors
    from engine.trainer import Trainer

    task = make_task(Path(a.out) / "task")
    cfg = load_config(overrides=overrides(task, a.out, "run", 3, ["max_steps=1"]))
    trainer = Trainer(config=cfg)
    trainer.train()
    real_write = StreamedSafetensors.write
    written = []

    def filling_write(self, key, tensor):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device", self._file.name)
        written.append(key)
        return real_write(self, key, tensor)

    StreamedSafetensors.write = filling_write
    target = Path(a.out) / "export" / "model"
    started = time.monotonic()
    try:
        checkpoint.save_model(trainer.ctx, str(target), "200KB")  # several shards
        error = None
    except locations.CheckpointError as e:
        error = {"type": type(e).__name__, "text": str(e)}
    seconds = time.monotonic() - started
    StreamedSafetensors.write = real_write
    trainer.save_model(str(target))  # room again: the same export now succeeds
    report(rank=trainer.env.rank, error=error, seconds=seconds, model=str(target),
           listing=sorted(p.name for p in target.parent.iterdir()))


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
