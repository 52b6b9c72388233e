"""Peak memory and throughput of full fine-tuning with AdamW, LOMO, AdaLomo and LoRA, ZeRO 0 and 3.

Run by hand:  .venv/bin/python bench/bench_methods.py [--hidden 512 --layers 8 --batch 2 --seq 256]

Every configuration trains the same model (a Llama built from a config, the default task's
character tokenizer), the same packed rows (every micro-batch exactly `batch` x `seq` tokens) in
the same order, through our Trainer on one rank, each in a fresh process so that peaks do not
carry over. Memory: on a GPU the CUDA peak of allocated tensor memory; on CPU the peak resident
set size, sampled every 2 ms, above the process's size just before the Trainer is built (the
libraries are imported by then, so what is left is model, optimizer, gradients and activations;
glibc's allocator caching is in it). Throughput: real tokens per second over the steps after
`warmup`. Targets (the LOMO paper reports 10.8% of the standard DeepSpeed set-up's memory;
CoLLie's chart about 2 x params bytes for LOMO against 30 x for Adam): LOMO <= 0.35 x AdamW's
peak at equal batch and sequence length, tokens/s >= 0.9 x AdamW's.

LOMO is shown with gradient clipping (its measure pass is a second backward; under ZeRO-3 a
second forward too) and without, since clipping is what costs it speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# (label, method, extra overrides)
RUNS = [("adamw", "full", []), ("lomo", "lomo", []), ("lomo, no clip", "lomo", ["optim.grad_clip=0"]),
        ("adalomo", "adalomo", []), ("lora", "lora", [])]
LR = {"full": 1e-3, "lomo": 1e-2, "adalomo": 1e-3, "lora": 1e-3}


def make_assets(root: Path, a) -> tuple[Path, Path]:
    """A model folder (config + the default tokenizer, no weights) and a training file."""
    from engine.data import default_task as dt
    assets = dt.ensure_default_assets(dt.default_root())
    tok = dt.build_tokenizer([])  # same alphabet: the default tokenizer
    model_dir = root / "model"
    tok.save_pretrained(model_dir)
    config = dt.default_model_config(len(tok), hidden=a.hidden, layers=a.layers, heads=a.heads,
                                     intermediate=a.hidden * 8 // 3)
    config.max_position_embeddings = max(config.max_position_embeddings, a.seq)
    config.save_pretrained(model_dir)
    rows = assets.train_path.read_text().splitlines()[: a.rows]
    train = root / "train.jsonl"
    train.write_text("\n".join(rows) + "\n")
    return model_dir, train


class PeakRSS:
    """Samples this process's resident set size in a thread and keeps the maximum."""

    def __init__(self, every: float = 0.002):
        import psutil
        self.proc, self.every, self.peak, self._stop = psutil.Process(), every, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.every)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


def child(a) -> None:
    """One configuration: train, print one JSON line with the measurements."""
    import psutil
    import torch
    from contract.config.load import load_config
    from engine.trainer import Trainer

    cuda = torch.cuda.is_available()
    overrides = [f"model.path={a.model}", f"data.train={a.train}", f"method={a.method}",
                 f"zero_stage={a.zero}", f"max_steps={a.warmup + a.steps}", f"batch_size={a.batch}",
                 f"data.max_length={a.seq}", "data.batching=packing", f"precision={a.precision}",
                 f"lr={LR[a.method]}", "optim.warmup_steps=0", "optim.scheduler=constant",
                 "eval.at_end=false", "eval.evaluators=[]", "checkpoint.save_at_end=false",
                 "control.enabled=false", "logging.tensorboard=false", f"output_dir={a.out}",
                 f"run_name={a.method}-{a.zero}-{os.getpid()}", *a.extra]
    cfg = load_config(overrides=overrides)
    base = psutil.Process().memory_info().rss
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as rss:
        trainer = Trainer(config=cfg)
        trainer.train()
    events = [json.loads(line) for line in trainer.folder.events.read_text().splitlines()]
    trainer.close()
    train = [e for e in events if e["type"] == "train" and e["step"] > a.warmup]
    setup = next(e for e in events if e["type"] == "setup")
    print("RESULT " + json.dumps({
        "peak_mib": (torch.cuda.max_memory_allocated() if cuda else rss.peak - base) / 2**20,
        "memory": "CUDA peak allocated" if cuda else "peak RSS above baseline",
        "tokens_per_s": sum(e["tokens"] for e in train) / sum(e["step_time"] for e in train),
        "parameters": setup["parameters"], "trainable": setup["trainable_parameters"],
        "precision": setup["precision"], "loss": [round(e["loss"], 4) for e in train]}), flush=True)


def run_one(a, model: Path, train: Path, out: Path, method: str, zero: int, extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--train", str(train), "--out", str(out),
           "--method", method, "--zero", str(zero), "--batch", str(a.batch), "--seq", str(a.seq),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--precision", a.precision,
           *[x for e in extra for x in ("--extra", e)]]
    return child_result(cmd, f"{method} zero {zero}")


def child_result(cmd: list[str], what: str) -> dict:
    """Run one measuring child process (offline) and return its RESULT line's values."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--child", action="store_true")
    for name in ("--model", "--train", "--out", "--method"):  # the child's own arguments
        ap.add_argument(name)
    ap.add_argument("--extra", action="append", default=[])
    a = ap.parse_args()
    if a.child:
        a.zero = a.zero if isinstance(a.zero, int) else a.zero[0]
        return child(a)
    with tempfile.TemporaryDirectory() as tmp:
        model, train = make_assets(Path(tmp), a)
        rows = []
        for zero in a.zero:
            for label, method, extra in RUNS:
                r = run_one(a, model, train, Path(tmp) / "runs", method, zero, extra)
                rows.append((label, zero, r))
                print(f"  {label:14s} zero {zero}: {r['peak_mib']:8.1f} MiB  {r['tokens_per_s']:8.1f} tok/s", flush=True)
    first = rows[0][2]
    print(f"\n{first['parameters']:,} parameters, precision {first['precision']}, micro-batch {a.batch} x "
          f"{a.seq} tokens, {a.steps} measured steps after {a.warmup}; memory: {first['memory']}\n")
    print("| method | ZeRO | trainable | peak memory (MiB) | x AdamW | tokens/s | x AdamW |")
    print("|---|---|---|---|---|---|---|")
    for label, zero, r in rows:
        ref = next(x for lb, z, x in rows if lb == "adamw" and z == zero)
        print(f"| {label} | {zero} | {r['trainable']:,} | {r['peak_mib']:.1f} | {r['peak_mib'] / ref['peak_mib']:.2f} "
              f"| {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / ref['tokens_per_s']:.2f} |")


if __name__ == "__main__":
    main()
