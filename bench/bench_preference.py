"""The embedded default's preference variant learns: held-out reward accuracy and exact match
over the steps of `./launch.sh train objective=<dpo|orpo|simpo|kto>`.

Run by hand:  .venv/bin/python bench/bench_preference.py objective=dpo [key=value ...]

Runs the same command a user types (the default preset, one override), reads the run's
events.jsonl and prints, for each evaluation, the training time so far, the held-out reward
accuracy and margin (the objective on held-out pairs), and the exact match of greedy answers
against the chosen answers. The default model starts from random weights, so a preference
objective alone learns to rank the answers long before it learns to write them: orpo (its
likelihood term) and `method=...` on an SFT-trained model (model.path) write them too.
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
    step_times = {e["step"]: e["step_time"] for e in train}
    print(f"\nworld size {setup['world_size']}, precision {setup['precision']}, "
          f"{setup['parameters']:,} parameters, {setup['total_steps']} steps\n")
    print("| step | training time (s) | held-out reward accuracy | reward margin | exact match | train loss |")
    print("|---|---|---|---|---|---|")
    losses = {e["step"]: e["loss"] for e in train}
    nan = float("nan")
    for e in (e for e in events if e["type"] == "eval"):
        trained = sum(t for s, t in step_times.items() if s <= e["step"])
        print(f"| {e['step']} | {trained:.0f} | {e.get('eval/rewards/accuracies', nan):.3f} | "
              f"{e.get('eval/rewards/margins', nan):.3f} | {e.get('eval/exact_match', nan):.3f} | "
              f"{losses.get(e['step'], nan):.4f} |")


if __name__ == "__main__":
    main()
