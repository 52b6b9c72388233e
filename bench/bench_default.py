"""The embedded default learns: exact-match on held-out prompts against training wall time.

Run by hand:  .venv/bin/python bench/bench_default.py [key=value ...]

Runs `./launch.sh train` on the default preset (the same command a new user types), then reads
the run's events.jsonl and prints, for each evaluation, the training time so far (from the first
step's start, evaluation time excluded and included) and the exact-match score. Target: >= 0.90
within 300 s of training on 2 CPU cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "app.cli", "train", f"output_dir={tmp}", "run_name=bench",
               "checkpoint.save_at_end=false", *sys.argv[1:]]
        subprocess.run(cmd, cwd=REPO, check=True)
        events = [json.loads(line) for line in (Path(tmp) / "bench" / "events.jsonl").read_text().splitlines()]
    train = [e for e in events if e["type"] == "train"]
    setup = next(e for e in events if e["type"] == "setup")
    start = train[0]["time"] - train[0]["step_time"]
    step_times = {e["step"]: e["step_time"] for e in train}
    print(f"\nworld size {setup['world_size']}, precision {setup['precision']}, "
          f"{setup['parameters']:,} parameters, {setup['total_steps']} steps\n")
    print("| step | training time (s) | wall time incl. evaluation (s) | exact match | eval loss |")
    print("|---|---|---|---|---|")
    reached = None
    for e in (e for e in events if e["type"] == "eval"):
        trained = sum(t for s, t in step_times.items() if s <= e["step"])
        em = e.get("eval/exact_match", float("nan"))
        print(f"| {e['step']} | {trained:.0f} | {e['time'] - start:.0f} | {em:.3f} | {e.get('eval/loss', float('nan')):.4f} |")
        if reached is None and em >= 0.9:
            reached = (e["step"], trained)
    if reached:
        print(f"\n>= 90% exact match at step {reached[0]} after {reached[1]:.0f} s of training (target <= 300 s)")
    else:
        print("\nexact match never reached 90%")


if __name__ == "__main__":
    main()
