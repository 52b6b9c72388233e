"""The embedded default's GRPO variant learns: the mean reward against wall time.

Run by hand:  .venv/bin/python bench/bench_grpo_default.py [--every 10] [key=value ...]

Runs `./launch.sh train objective=grpo` (what a new user types: the default task's SFT model is
trained first, supervisor.warm_start, then GRPO from it with exact-match rewards) in a fresh
output folder, then reads the GRPO run's events.jsonl and prints, every `--every` steps, the wall
time since its first step began and the mean reward of the steps' samples (their exact match,
as sampled) averaged over the last `--every` steps, beside the SFT model's held-out exact match
(greedy). Target (issue 30): the mean reward visibly rises within a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=int, default=10, help="steps per row of the table")
    a, overrides = p.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        began = time.monotonic()
        subprocess.run([sys.executable, "-m", "app.cli", "train", "objective=grpo", f"output_dir={tmp}",
                        "run_name=bench", "checkpoint.save_at_end=false", *overrides], cwd=REPO, check=True)
        total = time.monotonic() - began
        events = [json.loads(line) for line in (Path(tmp) / "bench" / "events.jsonl").read_text().splitlines()]
        sft = [json.loads(line) for line in (Path(tmp) / "default-sft" / "events.jsonl").read_text().splitlines()]
    train = [e for e in events if e["type"] == "train"]
    start = train[0]["time"] - train[0]["step_time"]
    sft_train = [e for e in sft if e["type"] == "train"]
    sft_em = [e.get("eval/exact_match") for e in sft if e["type"] == "eval"]
    print(f"\nSFT first: {len(sft_train)} steps, held-out exact match {sft_em[-1] if sft_em else 'n/a'}; "
          f"GRPO: {len(train)} steps; the whole command took {total:.0f} s\n")
    print(f"| GRPO step | wall time (s) | mean reward (last {a.every} steps) |")
    print("|---|---|---|")
    for at in range(a.every, len(train) + 1, a.every):
        window = train[at - a.every:at]
        reward = sum(e["reward"] for e in window) / len(window)
        print(f"| {window[-1]['step']} | {window[-1]['time'] - start:.0f} | {reward:.3f} |")


if __name__ == "__main__":
    main()
