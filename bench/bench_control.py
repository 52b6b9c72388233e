"""What the control plane costs a run, under ZeRO-2 and ZeRO-3 (2 ranks). Run by hand:

    .venv/bin/python bench/bench_control.py [--steps 300] [--chats 12] [--zero 2 3]

1. Throughput: training tokens/s with the control server on and a client connected but idle,
   against the same run with control disabled (target >= 0.99).
   Measured from the event log's wall clock between two steps, so every per-step cost (the
   boundary broadcast included) is in it.
2. Chat latency: time from a chat request sent at a random moment mid-training to its first
   streamed token, against one step time plus the first-token time of the same request on an
   idle (paused) engine (target <= 1.2).
3. The idle boundary itself: rank 0's own clock of the per-step broadcast, and its share of a
   step: the control plane's cost without the noise of two whole runs on a shared machine.

Both runs of a pair are the tiny default model on a slice of the default task, one after the
other (never at the same time: they would share the cores), started through the real entry
point (supervisor.launch.spawn -> DeepSpeed launcher -> engine.worker).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from supervisor.client import RunClient  # noqa: E402
from control_runs import events, launch, task_files, wait_exit  # noqa: E402
from supervisor.procs import kill_group  # noqa: E402
from contract.run_folder import EventTail  # noqa: E402

PROMPT = "reverse: planet\n"
WINDOW_SKIP = 20  # steps left out at the start of the throughput window (warm-up)


def throughput(run, first: int, last: int) -> float:
    """Tokens per second of wall clock from step `first` to step `last` (event log times)."""
    train = {e["step"]: e for e in events(run) if e["type"] == "train"}
    tokens = sum(train[s]["tokens"] for s in range(first + 1, last + 1))
    return tokens / (train[last]["time"] - train[first]["time"])


def step_time(run, first: int, last: int) -> float:
    train = {e["step"]: e for e in events(run) if e["type"] == "train"}
    return (train[last]["time"] - train[first]["time"]) / (last - first)


def first_token_s(client: RunClient) -> float:
    """Seconds from sending a chat to its first streamed piece (or its answer, if empty)."""
    started = time.perf_counter()
    gen = client.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=0)
    first = None
    for _ in gen:
        first = first or time.perf_counter()
    return (first or time.perf_counter()) - started


def reach_step(run, step: int) -> None:
    """Wait for `step` the cheap way (new lines only, twice a second): on 2 cores, a waiter
    that re-read the whole log often would slow the run it measures."""
    tail, done = EventTail(run.folder.events), 0
    while done < step:
        assert run.process.poll() is None, f"run {run.folder.root.name} ended early"
        done = max([done] + [e["step"] for e in tail.poll() if e.get("type") == "train"])
        time.sleep(0.5)


def quiet_run(tmp: Path, task: dict, zero: int, steps: int) -> float:
    """The same run as `live_run` (same max_steps, so the same schedule) with control off; it
    cannot be told to stop, so its process group is ended once the window is measured."""
    run = launch(tmp, f"off{zero}", task, f"zero_stage={zero}", f"max_steps={steps + 100000}",
                 "control.enabled=false")
    reach_step(run, steps)
    tps = throughput(run, WINDOW_SKIP, steps)
    kill_group(run.process.pid)
    run.process.wait(timeout=60)
    return tps


def live_run(tmp: Path, task: dict, zero: int, steps: int, chats: int) -> dict:
    """Idle-client throughput over `steps`, then chats mid-training, then chats while paused."""
    run = launch(tmp, f"on{zero}", task, f"zero_stage={zero}", f"max_steps={steps + 100000}")
    client = RunClient.connect(run.folder.root, timeout=300)  # connected, then idle
    client.status()
    reach_step(run, steps)
    boundary = client.status().boundary  # rank 0's own clock of the idle exchanges
    tps = throughput(run, WINDOW_SKIP, steps)
    step_s = step_time(run, WINDOW_SKIP, steps)
    mid = []
    for _ in range(chats):
        time.sleep(random.uniform(0, step_s))  # a random phase of the step
        mid.append(first_token_s(client))
    client.pause()
    idle = [first_token_s(client) for _ in range(chats)]
    client.stop(save=False)
    assert wait_exit(run, timeout=600) == 0
    exchange_s = boundary["idle_seconds"] / max(1, boundary["idle_exchanges"])
    return {"tps": tps, "step_s": step_s, "mid": mid, "idle": idle, "exchange_s": exchange_s}


def measure(tmp: Path, task: dict, zero: int, args) -> dict:
    """`repeats` pairs of runs, alternating which goes first (the machine's load drifts)."""
    offs, ons = [], []
    for r in range(args.repeats):
        for kind in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if kind == "off":
                offs.append(quiet_run(tmp, task, zero, args.steps))
            else:
                ons.append(live_run(tmp, task, zero, args.steps, args.chats))
    mid = statistics.median(x for on in ons for x in on["mid"])
    idle = statistics.median(x for on in ons for x in on["idle"])
    step_s = statistics.median(on["step_s"] for on in ons)
    return {"off": statistics.median(offs), "on": statistics.median(on["tps"] for on in ons),
            "pairs": [on["tps"] / off for on, off in zip(ons, offs)], "step_s": step_s,
            "mid": mid, "idle": idle, "exchange_s": statistics.median(on["exchange_s"] for on in ons)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs per ZeRO stage")
    parser.add_argument("--zero", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    random.seed(0)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-control-") as tmp_dir:
        tmp = Path(tmp_dir)
        task = task_files(tmp / "task")
        for zero in args.zero:
            rows.append((zero, measure(tmp, task, zero, args)))
    print(f"\ncontrol plane cost: 2 ranks, tiny default model, {args.steps} steps, {args.repeats} pair(s) "
          f"of runs per stage, {args.chats} chats (8 new tokens) per live run; load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print(f"{'ZeRO':>4} | {'tok/s off':>9} | {'tok/s on':>8} | {'ratio':>5} (>=0.99) | {'pairs':>11} | "
          f"{'exchange ms':>11} | {'of step':>7} | {'step s':>6} | {'1st tok idle':>12} | "
          f"{'1st tok mid':>11} | {'ratio':>5} (<=1.2)")
    for zero, m in rows:
        latency_ratio = m["mid"] / (m["step_s"] + m["idle"])
        pairs = "/".join(f"{x:.2f}" for x in m["pairs"])
        print(f"{zero:>4} | {m['off']:>9.0f} | {m['on']:>8.0f} | {m['on'] / m['off']:>5.3f}          | "
              f"{pairs:>11} | {m['exchange_s'] * 1e3:>11.3f} | {m['exchange_s'] / m['step_s']:>7.2%} | "
              f"{m['step_s']:>6.3f} | {m['idle']:>12.4f} | {m['mid']:>11.4f} | {latency_ratio:>5.3f}")
    print("\nexchange ms: rank 0's own time in the idle per-step broadcast (the control plane's whole "
          "per-step work when no command is queued); 'of step' is its share of a step.")


if __name__ == "__main__":
    main()
