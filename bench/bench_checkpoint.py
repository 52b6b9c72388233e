"""Checkpoint save / load time and memory against DeepSpeed's own, under ZeRO-2 and ZeRO-3.

    .venv/bin/python bench/bench_checkpoint.py [--zero 2 3] [--hidden 512] [--layers 8] [--repeats 3]

For each ZeRO stage one 2-rank run (the real DeepSpeed launcher, gloo on CPU) builds a Llama of
the given size on the default task, trains 2 steps (so that the optimizer has state), then on
the same engine, alternating so that neither side gets the warmer page cache:

- `save_checkpoint` (ours: DeepSpeed's layout + position, sampler, RNG, callbacks, hashes,
  marker, atomic rename, `latest`) against `engine.save_checkpoint` alone;
- `load_checkpoint` (ours: every check and hash first, then DeepSpeed's load and the rest)
  against `engine.load_checkpoint` alone;
- `save_model` (Hugging Face shards of `--shard-mb`, ZeRO-3 gathered shard by shard), whose
  extra memory must stay within one shard.

Times are the median over `--repeats`, the slower rank's (a collective ends with the last rank);
every timed operation starts after os.sync(), and the order alternates between repeats. On a
shared machine the disk makes whole-operation times noisy, so the table also gives what our
functions add around DeepSpeed's part in the same call ("added", clocked apart) and the ratio
that makes with DeepSpeed's own time.
Memory is the peak of anonymous resident memory (RssAnon: real allocations, not the page cache
or the memory-mapped files being hashed) above what the rank held just before (after
malloc_trim, so that freed memory kept by the allocator cannot hide new allocations), sampled
every 2 ms. Targets: ours <= 1.2 x DeepSpeed's time; no rank above its ZeRO share (what it held before)
plus one shard.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
TAG = "BENCH"


# -- memory sampling --------------------------------------------------------------------------
def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak RssAnon above the level at entry, sampled by a thread while the block runs."""

    def __enter__(self):
        self.base = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())
        self.extra = self.peak - self.base


# -- one rank -------------------------------------------------------------------------------------
INNER = {"seconds": 0.0}  # time spent inside DeepSpeed's own save / load during an operation


def clock_deepspeed(engine) -> None:
    """Time every call of engine.save_checkpoint / load_checkpoint (ours calls them too), so that
    what our functions add around DeepSpeed's part is measured apart from the disk's noise."""
    for name in ("save_checkpoint", "load_checkpoint"):
        original = getattr(engine, name)

        def clocked(*args, _original=original, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                INNER["seconds"] += time.perf_counter() - started

        setattr(engine, name, clocked)


def timed(fn) -> tuple[float, int, float]:
    """(seconds, extra anonymous memory, seconds of it inside DeepSpeed's save / load)."""
    import ctypes

    import torch.distributed as dist
    os.sync()  # no operation pays for the writeback of the one before
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system: a tight baseline
    dist.barrier()
    INNER["seconds"] = 0.0
    with PeakMemory() as mem:
        started = time.perf_counter()
        fn()
        seconds = time.perf_counter() - started
    dist.barrier()
    return seconds, mem.extra, INNER["seconds"]


def worker(args) -> None:
    import torch

    from engine import checkpoint as ck
    from contract.config.load import load_config
    from engine.trainer import Trainer
    from tests.dist_utils import report

    task = model_folder(Path(args.out), args.hidden, args.layers)
    cfg = load_config(overrides=[
        f"model.path={task}", f"zero_stage={args.zero}", "nproc=2", "max_steps=2", "batch_size=4",
        "data.max_length=32", "eval.at_end=false", "checkpoint.save_at_end=false", "control.enabled=false",
        "logging.tensorboard=false", f"output_dir={args.out}", f"run_name=z{args.zero}"])
    trainer = Trainer(config=cfg)
    trainer.train()
    engine, out = trainer.engine, Path(args.out) / f"z{args.zero}"
    rank = trainer.env.rank
    ours_dir, ds_dir = out / "checkpoints", out / "deepspeed"
    clock_deepspeed(engine)
    trainer.save_checkpoint(str(ours_dir / "warmup"))  # first-call costs (sampler, imports) out
    rows: dict[str, list] = {k: [] for k in ("save_ours", "save_ds", "load_ours", "load_ds", "model")}
    for i in range(args.repeats):
        pairs = [("save_ds", lambda: engine.save_checkpoint(str(ds_dir / f"r{i}"), tag="t")),
                 ("save_ours", lambda: trainer.save_checkpoint(str(ours_dir / f"r{i}"))),
                 ("load_ours", lambda: trainer.load_checkpoint(str(ours_dir / f"r{i}"))),
                 ("load_ds", lambda: engine.load_checkpoint(str(ds_dir / f"r{i}"), tag="t"))]
        for j in ((0, 1, 2, 3) if i % 2 == 0 else (1, 0, 3, 2)):  # alternate who goes first
            rows[pairs[j][0]].append(timed(pairs[j][1]))
        info = {}
        rows["model"].append(timed(lambda: info.update(
            ck.save_model(trainer, str(out / f"model{i}"), max_shard_size=args.shard_mb * 2**20))))
        if rank == 0:  # keep the disk small: only the latest repeat stays
            for d in (ds_dir / f"r{i}", ours_dir / f"r{i}", out / f"model{i}"):
                shutil.rmtree(d, ignore_errors=True)
        torch.distributed.barrier()
    held = sum(getattr(p, "ds_tensor", p).numel() * p.element_size() for p in engine.module.parameters())
    size = sum(f.stat().st_size for f in (ours_dir / "warmup").rglob("*") if f.is_file())
    report(rank=rank, zero=args.zero, rows=rows, held_param_bytes=held, checkpoint_bytes=size,
           shard_bytes=info.get("largest_shard", 0), model_bytes=info.get("bytes", 0), precision=trainer.precision)
    trainer.close()


def model_folder(out: Path, hidden: int, layers: int) -> str:
    """The default task's model folder with a bigger Llama config (weights built from it)."""
    from engine.data.default_task import default_root, ensure_default_assets
    assets = ensure_default_assets(default_root())
    folder = out / f"model-h{hidden}-l{layers}"
    if not folder.exists():
        tmp = Path(tempfile.mkdtemp(dir=out))
        shutil.copytree(assets.model_dir, tmp / "m")
        config = json.loads((tmp / "m" / "config.json").read_text())
        config.update(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      head_dim=hidden // config["num_attention_heads"])
        (tmp / "m" / "config.json").write_text(json.dumps(config))
        try:
            os.rename(tmp / "m", folder)
        except OSError:  # the other rank was first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


# -- the driver ---------------------------------------------------------------------------------
def run_stage(zero: int, args, out: Path) -> list[dict]:
    from tests.dist_utils import deepspeed_command, parse_results
    cmd = deepspeed_command(Path(__file__), 2, ("--worker", "--zero", str(zero), "--out", str(out),
                                                  "--hidden", str(args.hidden), "--layers", str(args.layers),
                                                  "--repeats", str(args.repeats), "--shard-mb", str(args.shard_mb)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.exit(f"ZeRO-{zero} run failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
    return sorted(parse_results(proc), key=lambda r: r["rank"])


def slowest(ranks: list[dict], key: str, added: bool = False) -> float:
    """Median over repeats of the slower rank's time (`added`: less the time inside DeepSpeed)."""
    per_repeat = zip(*[[t - inner if added else t for t, _, inner in r["rows"][key]] for r in ranks])
    return statistics.median(max(ts) for ts in per_repeat)


def peaks(ranks: list[dict], key: str) -> list[float]:
    return [max(m for _, m, _ in r["rows"][key]) / 2**20 for r in ranks]


def table(results: dict[int, list[dict]]) -> str:
    mb = lambda xs: "/".join(f"{x:.0f}" for x in xs)  # noqa: E731
    lines = [f"{'ZeRO':>4} {'operation':<16} {'ours s':>8} {'DS s':>8} {'ratio':>6} {'added s':>8} "
             f"{'(DS+added)/DS':>13}  {'extra MB/rank ours':>18} {'DS':>9}  {'one shard MB':>12}"]
    for zero, ranks in results.items():
        shard = ranks[0]["shard_bytes"] / 2**20
        for op in ("save", "load"):
            ours, ds = slowest(ranks, f"{op}_ours"), slowest(ranks, f"{op}_ds")
            added = slowest(ranks, f"{op}_ours", added=True)
            lines.append(f"{zero:>4} {op + '_checkpoint':<16} {ours:>8.3f} {ds:>8.3f} {ours / ds:>6.2f} "
                         f"{added:>8.3f} {(ds + added) / ds:>13.2f}  {mb(peaks(ranks, op + '_ours')):>18} "
                         f"{mb(peaks(ranks, op + '_ds')):>9}  {shard:>12.0f}")
        lines.append(f"{zero:>4} {'save_model':<16} {slowest(ranks, 'model'):>8.3f} {'-':>8} {'-':>6} {'-':>8} "
                     f"{'-':>13}  {mb(peaks(ranks, 'model')):>18} {'-':>9}  {shard:>12.0f}")
    first = next(iter(results.values()))[0]
    lines.append(f"model {first['model_bytes'] / 2**20:.0f} MB ({first['precision']}), training checkpoint "
                 f"{first['checkpoint_bytes'] / 2**20:.0f} MB, largest export shard {first['shard_bytes'] / 2**20:.0f} MB; "
                 "bound = one shard above what the rank held before the operation")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zero", type=int, nargs="+", default=[2, 3])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shard-mb", type=int, default=16)
    p.add_argument("--out", default="")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    if args.worker:
        args.zero = args.zero[0]
        return worker(args)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-ckpt-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        results = {zero: run_stage(zero, args, out) for zero in args.zero}
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    print(table(results))


if __name__ == "__main__":
    main()
