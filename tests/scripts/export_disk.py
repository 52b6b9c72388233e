"""A model export under ZeRO-3 whose write fails on rank 0 in the middle of a shard (a full disk,
injected: ENOSPC after the first tensor); run by tests/scripts/ckpt_disk.py --export, in its
launch. Under ZeRO-3 every tensor is gathered by every rank, so rank 0 must go on through the
gathers the other rank waits in: both ranks must come out of the export with the same
DiskFullError, at once, and a second export must then succeed (the test loads it in
transformers: here, under ZeRO-3, `from_pretrained` would be collective)."""

import errno
import time
from pathlib import Path

from ckpt_common import make_task, overrides
from engine.checkpoint import locations


def export_fills_the_disk(out: Path, name: str) -> dict:
    """Train the run `name` one step under ZeRO-3 in `out`, export with the injected full disk,
    then again: what this rank saw."""
    from contract.config.load import load_config
    from engine.checkpoint import atomic
    from engine import checkpoint
    from engine.checkpoint.stream_safetensors import StreamedSafetensors
    from engine.trainer import Trainer

    task = make_task(out / "task")
    cfg = load_config(overrides=overrides(task, str(out), name, 3, ["max_steps=1"]))
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
    target = out / "export" / "model"
    started = time.monotonic()
    try:
        checkpoint.save_model(trainer.ctx, str(target), "200KB")  # several shards
        error = None
    except locations.CheckpointError as e:
        error = {"type": type(e).__name__, "text": str(e)}
    seconds = time.monotonic() - started
    StreamedSafetensors.write = real_write
    trainer.save_model(str(target))  # room again: the same export now succeeds
    return dict(rank=trainer.env.rank, error=error, seconds=seconds, model=str(target),
                listing=sorted(p.name for p in target.parent.iterdir()))

