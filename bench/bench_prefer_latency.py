"""From "prefer" in the chat to the first batch that holds the pair, in a DPO run.

Run by hand:  .venv/bin/python bench/bench_prefer_latency.py [--steps 150] [--batch 32]

A one-rank DPO run of the default task's pairs (the embedded model, fp32) while a client sends
`prefer` (a new pair) every PREFER_EVERY steps, as the chat's "A is better" does. For each pair:
seconds from the client sending it to the start of the first step whose batch holds it (that
step's train event time minus its step time). The target is at most one step plus the work of
the boundary that takes the pair; the table splits each latency into the rest of the step that
was running when the pair was sent and that boundary's work, and counts the boundaries that
passed without taking it (0: the pair is in the very next batch).
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
from contract.events import EventType  # noqa: E402
from contract.run_folder import make_run_folder  # noqa: E402
from engine.data import default_task  # noqa: E402
from supervisor.client import RunClient  # noqa: E402
from supervisor.launch import spawn  # noqa: E402
from control_runs import events, wait_exit  # noqa: E402

ROWS, WARMUP, PREFER_EVERY = 4000, 15, 10


def launch(root: Path, steps: int, batch: int):
    pairs = [default_task.preference_row(r) for r in default_task.make_examples(ROWS, 5, "train")]
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = load_config(overrides=[
        f"output_dir={root / 'runs'}", "run_name=prefer", "nproc=1", f"max_steps={steps}",
        f"batch_size={batch}", f"data.train={data}", "objective=dpo", "data.max_length=48",
        "precision=fp32", "logging.tensorboard=false", "checkpoint.save_at_end=false", "eval.at_end=false",
        "eval.every_n_steps=0", "teach.per_step=4", "teach.steps=5", "teach.check_after=0",
        "teach.max_new_tokens=8"])
    return spawn(cfg, make_run_folder(cfg), extra_env={"LIVETUNE_CACHE": str(root / "cache")})


def feed(run, steps: int, sent: list[tuple[float, str]]) -> None:
    """A new pair every PREFER_EVERY steps until near the end; (send time, inbox id) in `sent`."""
    client = RunClient.connect(run.folder.root, timeout=600)
    n = 0
    while run.process.poll() is None:
        train = [e["step"] for e in events(run) if e["type"] == EventType.TRAIN]
        if train and train[-1] >= steps - PREFER_EVERY:
            return
        if train and train[-1] >= WARMUP + n * PREFER_EVERY:
            n += 1
            started = time.time()
            try:
                answer = client.prefer(f"capital: zo{n}rb\n", chosen=f"q{n}x", rejected=f"zo{n}rb")
            except Exception:  # noqa: BLE001 - the run ended in between
                return
            sent.append((started, answer.id))
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_prefer_"))
    run = launch(root, args.steps, args.batch)
    sent: list[tuple[float, str]] = []
    feeder = threading.Thread(target=feed, args=(run, args.steps, sent), daemon=True)
    feeder.start()
    assert wait_exit(run, timeout=1800) == 0, f"the run failed: {run.folder.logs}"
    feeder.join(timeout=60)
    log = events(run)
    taken = {e["id"]: e["step"] for e in log if e["type"] == EventType.TEACH}
    train = {e["step"]: e for e in log if e["type"] == EventType.TRAIN}
    plain = statistics.median(e["step_time"] for s, e in train.items() if s > WARMUP and s - 1 not in taken.values())
    print("| pair | latency (s) | rest of the step in progress (s) | boundary work (s) | boundaries missed |")
    print("|---|---|---|---|---|")
    for i, (started, entry) in enumerate(sent, 1):
        step = taken[entry] + 1  # the boundary after step taken[entry] took it; this step trains on it
        assert train[step]["samples_per_source"].get("inbox", 0) > 0, train[step]
        begun = train[step]["time"] - train[step]["step_time"]
        # the steps that ended after the pair was sent and before the one that took it
        missed = sum(1 for s, e in train.items() if started < e["time"] and s < taken[entry])
        rest = max(0.0, train[taken[entry]]["time"] - started)
        print(f"| {i} | {begun - started:.3f} | {rest:.3f} | {begun - train[taken[entry]]['time']:.3f} | {missed} |")
    print(f"\nmedian step {plain:.3f} s; latency = the rest of the step in progress + the boundary's work "
          f"(the pair's tokenization, the margin's 'before' forward) when no boundary is missed")

if __name__ == "__main__":
    main()
