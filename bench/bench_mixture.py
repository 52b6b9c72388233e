"""What mixing data sources costs, and how soon a taught answer is trained on. Run by hand:

    .venv/bin/python bench/bench_mixture.py [--steps 120] [--batch 64]

Three runs of the tiny default model on the same 6,000 rows of the default task, 1 rank, one
after the other, through the real entry point (supervisor.launch.spawn -> DeepSpeed launcher ->
engine.worker):

1. single: the rows as one source (data.train);
2. three: the same rows split into three files, data.sources with equal weights;
3. three+inbox: as 2, while a client teaches a new pair every TEACH_EVERY steps (each mixed in at
   teach.per_step samples for teach.steps batches).

Throughput: tokens per second of wall clock between two steps after a warm-up (event log times;
every per-step cost, the boundary and its draws included), ratio to the single source (target
>= 0.98). The teach generations themselves (the greedy "old" answer at the boundary) are left out
of run 3's window: the steps in which a teach was answered are not counted.

Teach latency: from the client sending Teach to the start of the first step whose batch holds the
pair (the step after the boundary that took it: its train event's time minus its step time),
against one step time. It is the wait for the next boundary plus the greedy answer the engine
gives first (teach.max_new_tokens tokens), then the pair is in the very next batch.

Also, without the model: the loader alone (plain sampler vs mixtures), microseconds per batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from contract.config.load import load_config  # noqa: E402
from contract.run_folder import make_run_folder  # noqa: E402
from engine.data import default_task  # noqa: E402
from supervisor.client import RunClient  # noqa: E402
from supervisor.launch import spawn  # noqa: E402
from control_runs import events, wait_exit  # noqa: E402

ROWS, WARMUP, TEACH_EVERY = 6000, 20, 15


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def launch(root: Path, name: str, steps: int, batch: int, data: list[str]):
    cfg = load_config(overrides=[
        f"output_dir={root / 'runs'}", f"run_name={name}", "nproc=1", f"max_steps={steps}",
        f"batch_size={batch}", "data.max_length=32", "data.batching=random", "precision=fp32",
        "logging.tensorboard=false", "checkpoint.save_at_end=false", "eval.at_end=false",
        "optim.warmup_steps=10", "teach.per_step=4", "teach.steps=10", "teach.check_after=0",
        "teach.max_new_tokens=8", *data])
    return spawn(cfg, make_run_folder(cfg), extra_env={"LIVETUNE_CACHE": str(root / "cache")})


def throughput(run, skip: set[int]) -> tuple[float, float]:
    """(tokens/s of wall clock over the steps after the warm-up, not in `skip`; median step time)."""
    train = {e["step"]: e for e in events(run) if e["type"] == "train"}
    steps = [s for s in sorted(train) if s > WARMUP and s - 1 in train and s not in skip]
    tokens = sum(train[s]["tokens"] for s in steps)
    seconds = sum(train[s]["time"] - train[s - 1]["time"] for s in steps)
    return tokens / seconds, statistics.median(train[s]["step_time"] for s in steps)


def feed_inbox(run, steps: int, sent: list[tuple[float, str]]) -> None:
    """Teach a new pair every TEACH_EVERY steps until the run ends; (send time, id) in `sent`."""
    client = RunClient.connect(run.folder.root, timeout=600)
    word = 0
    while run.process.poll() is None:
        train = [e["step"] for e in events(run) if e["type"] == "train"]
        if train and train[-1] >= steps - TEACH_EVERY:
            return
        if train and train[-1] >= WARMUP + word * TEACH_EVERY:
            word += 1
            started = time.time()
            try:
                answer = client.teach(f"capital: zo{word}rb\n", f"q{word}x")
            except Exception:  # noqa: BLE001 - the run ended in between
                return
            sent.append((started, answer.id))
        time.sleep(0.05)


def teach_latency(run, sent: list[tuple[float, str]]) -> list[float]:
    """Seconds from each Teach sent to the start of the first step that trained on it."""
    log = events(run)
    taught = {e["id"]: e["step"] for e in log if e["type"] == "teach"}
    train = {e["step"]: e for e in log if e["type"] == "train"}
    out = []
    for started, entry in sent:
        step = taught[entry] + 1
        assert train[step]["samples_per_source"].get("inbox", 0) > 0, train[step]
        out.append(train[step]["time"] - train[step]["step_time"] - started)
    return out


def loader_only(rows: list[dict], batch: int, batches: int = 400) -> dict[str, float]:
    """Microseconds per batch of the batch sampler alone (which samples; collation is the same
    code either way): the plain sampler vs mixtures."""
    from engine.data import build_dataloader, build_dataset
    from engine.data.mixture import MixtureDataset, Source, source_seed
    from engine.model.loading import load_tokenizer
    tok = load_tokenizer(default_task.ensure_default_assets(default_task.default_root()).model_dir, "model.path")
    whole, _ = build_dataset(rows, tok, max_length=32)
    parts = [build_dataset(rows[i::3], tok, max_length=32)[0] for i in range(3)]

    def timed(dataset, setup=None) -> float:
        loader = build_dataloader(dataset, micro_batch_size=batch, seed=1, strategy="random", tokenizer=tok,
                                  max_length=32)
        if setup is not None:
            setup(loader.batch_sampler.mixture)
        sampler = loader.batch_sampler
        started, n = time.perf_counter(), 0
        for epoch in range(100):
            sampler.set_epoch(epoch)
            for _ in sampler:
                n += 1
                if n == batches:
                    return (time.perf_counter() - started) / n * 1e6
        return (time.perf_counter() - started) / n * 1e6

    def three():
        return MixtureDataset([Source(f"part{i}", p, seed=source_seed(1, f"part{i}", i == 0))
                               for i, p in enumerate(parts)])

    def schedules(m):
        m.schedules = [{"source": 0, "index": i, "per_step": 4, "steps_left": 10**6, "id": str(i)} for i in range(2)]
    return {"plain": timed(whole), "single": timed(MixtureDataset([Source("train", whole, seed=1)])),
            "three": timed(three()), "three+schedules": timed(three(), schedules)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--loader-only", action="store_true", help="only the sampler timings")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_mixture_"))
    rows = default_task.make_examples(ROWS, 5, "train")
    whole = write_rows(root / "train.jsonl", rows)
    parts = [write_rows(root / f"part{i}.jsonl", rows[i::3]) for i in range(3)]
    sources = "data.sources=" + json.dumps([{"path": p, "weight": 1} for p in parts])
    print("batch sampler alone, us per global batch:",
          {k: round(v, 1) for k, v in loader_only(rows, args.batch).items()})
    if args.loader_only:
        return
    results, latencies = {}, []
    for name, data in (("single", [f"data.train={whole}"]), ("three", [sources]), ("three+inbox", [sources])):
        run = launch(root, name.replace("+", "_"), args.steps, args.batch, data)
        sent: list[tuple[float, str]] = []
        feeder = None
        if name == "three+inbox":
            feeder = threading.Thread(target=feed_inbox, args=(run, args.steps, sent), daemon=True)
            feeder.start()
        assert wait_exit(run, timeout=1800) == 0, name
        if feeder is not None:
            feeder.join(timeout=60)
        skip = {e["step"] + 1 for e in events(run) if e["type"] == "teach"}  # the teach generation's step gap
        results[name] = throughput(run, skip)
        if sent:
            latencies = teach_latency(run, sent)
    base = results["single"][0]
    print(f"\n| run | tokens/s | ratio to single | median step (s) |\n|---|---|---|---|")
    for name, (tps, step) in results.items():
        print(f"| {name} | {tps:,.0f} | {tps / base:.3f} | {step:.3f} |")
    if latencies:
        step = results["three+inbox"][1]
        print(f"\nteach -> first batch with it: median {statistics.median(latencies):.3f} s, max "
              f"{max(latencies):.3f} s over {len(latencies)} teaches; one step {step:.3f} s "
              f"(median ratio {statistics.median(latencies) / step:.2f})")


if __name__ == "__main__":
    main()
