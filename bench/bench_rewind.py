"""What a rewind costs: in place from disk, in place from a snapshot, against stop + relaunch.

    .venv/bin/python bench/bench_rewind.py [--zero 2] [--hidden 512] [--layers 8] [--repeats 3]

One model, one checkpoint, 2 ranks (the real DeepSpeed launcher, gloo on CPU), the run driven
through its control plane as a user would drive it:

1. A live run trains 2 steps, saves the training checkpoint step-2 (`save`) and keeps the
   snapshot s2 (`snapshot`), then alternates `rewind 2` (from disk: every check and hash, then
   DeepSpeed's load into the running engines) and `rewind s2` (from host memory), one step
   trained between rewinds, `--repeats` times each. A rewind's time is the command's own
   (the control plane's `seconds` in its `done` event: from the moment every rank starts it
   at the step boundary until every rank has loaded it), the median over the repeats.
2. The run is then stopped (`stop`, no save) and the same run is relaunched with
   `resume=<step-2>` in the same layout. The relaunch's time is the stop (queued -> the
   launcher has exited) plus the new launch (the launcher starts -> every rank is ready to train
   its first step: model built, engine up, checkpoint loaded; the `on_train_begin` hook).

Printed: each time, its ratio to the relaunch (targets: disk <= 0.2 x, snapshot <= 0.05 x),
and the snapshot's host memory (every rank's part, DeepSpeed's files on /dev/shm) against the
checkpoint's size on disk. Times are wall-clock on whatever else the machine is doing: say how
loaded it was when you quote them.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def config_overrides(args, run_name: str, resume: str = "") -> list[str]:
    from bench_checkpoint import model_folder  # the default task's model, bigger
    model = model_folder(Path(args.out), args.hidden, args.layers)
    return [f"model.path={model}", f"zero_stage={args.zero}", "nproc=2", "max_steps=1000", "batch_size=4",
            "data.max_length=32", "precision=fp32", "eval.at_end=false", "checkpoint.save_at_end=false",
            "checkpoint.every_n_steps=0", "checkpoint.keep_last=0", "control.enabled=true",
            "logging.tensorboard=false", f"output_dir={args.out}", f"run_name={run_name}",
            *([f"resume={resume}"] if resume else [])]


# -- inside the ranks ---------------------------------------------------------------------------
def live_worker(args) -> None:
    """Train, save, snapshot, rewind back and forth, then stop (no save)."""
    from contract.config.load import load_config
    from contract.protocol.branch_commands import Rewind, Snapshot
    from contract.protocol.commands import Save, Stop
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.trainer import Trainer
    from tests.dist_utils import report

    plan = {2: [Save(), Snapshot(snapshot="s2")]}
    for i in range(2 * args.repeats):  # a step trained between rewinds, disk and snapshot in turn
        plan[3 + i] = [Rewind(target="2") if i % 2 == 0 else Rewind(target="s2")]
    last = 3 + 2 * args.repeats
    trained = [0]

    class Driver(Callback):
        def on_train_batch_end(self, trainer, loss):
            trained[0] += 1
            if trainer.env.rank != 0:
                return
            for cmd in plan.get(trained[0], []) + ([Stop(save=False)] if trained[0] == last else []):
                req = f"bench-{trained[0]}-{cmd.name}"
                trainer.control.commands.put(req, cmd, Reply(req, None))
                if isinstance(cmd, Stop):
                    report(stop_queued=time.time())

    trainer = Trainer(config=load_config(overrides=config_overrides(args, "live")), callbacks=[Driver()])
    trainer.train()
    if trainer.env.rank == 0:
        report(folder=str(trainer.folder.root))
    trainer.close()


def resume_worker(args) -> None:
    """Start with resume=<step-2>; report when every rank is ready for its first step, then end."""
    entered = time.time()  # the rank's Python is up (the launcher and interpreter start are before)
    import torch.distributed as dist

    from contract.config.load import load_config
    from engine.callbacks import Callback, Signal
    from engine.trainer import Trainer
    from tests.dist_utils import report

    class Ready(Callback):
        def on_train_begin(self, trainer):
            dist.barrier()  # ready = the slower rank is ready
            if trainer.env.rank == 0:
                report(ready=time.time(), entered=entered, built=built[0])
            return Signal(stop=True)  # ready is all this run is for

    cfg = load_config(overrides=config_overrides(args, "relaunched", resume=args.resume))
    built = [0.0]
    trainer = Trainer(config=cfg, callbacks=[Ready()])
    built[0] = time.time()  # model, engine, control plane, checkpoint loaded
    trainer.train()
    trainer.close()


# -- the driver ---------------------------------------------------------------------------------
def launch(args, mode: str, extra: tuple[str, ...] = ()) -> tuple[list[dict], float, float]:
    """Run the ranks in `mode`; (their results, launch time, exit time)."""
    from tests.dist_utils import deepspeed_command, parse_results
    cmd = deepspeed_command(Path(__file__), 2, ("--worker", mode, "--zero", str(args.zero), "--out", args.out,
                                                  "--hidden", str(args.hidden), "--layers", str(args.layers),
                                                  "--repeats", str(args.repeats), *extra))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    started = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    ended = time.time()
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
    return parse_results(proc), started, ended


def measure(args) -> dict:
    results, _, exited = launch(args, "live")
    found = {k: v for r in results for k, v in r.items()}
    folder = Path(found["folder"])
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    done = [e for e in events if e["type"] == "command" and e["status"] == "done" and e["cmd"] == "rewind"]
    disk = [e["seconds"] for e in done if not str(e["result"]["source"]).startswith("snapshot:")]
    snap = [e["seconds"] for e in done if str(e["result"]["source"]).startswith("snapshot:")]
    snapshot = next(e for e in events if e["type"] == "snapshot")
    checkpoint = next(e for e in events if e["type"] == "checkpoint")
    ckpt_path = str(checkpoint["path"]).removeprefix("file://")
    ckpt_bytes = sum(f.stat().st_size for f in Path(ckpt_path).rglob("*") if f.is_file())
    stop_s = exited - found["stop_queued"]
    results, launched, _ = launch(args, "resume", ("--resume", ckpt_path))
    ready = next(r for r in results if "ready" in r)
    return {"disk": disk, "snapshot": snap, "stop": stop_s, "start": ready["ready"] - launched,
            "to_python": ready["entered"] - launched, "to_built": ready["built"] - ready["entered"],
            "snapshot_bytes": snapshot["bytes"], "checkpoint_bytes": ckpt_bytes}


def table(m: dict, args) -> str:
    relaunch = m["stop"] + m["start"]
    disk, snap = statistics.median(m["disk"]), statistics.median(m["snapshot"])
    rows = [("rewind from disk (in place)", disk, "<= 0.2"), ("rewind from a snapshot (in place)", snap, "<= 0.05"),
            ("stop + relaunch with resume", relaunch, "1")]
    head = f"2 ranks, ZeRO {args.zero}, hidden {args.hidden} x {args.layers} layers"
    lines = [f"{head:<42} {'seconds':>8} {'x relaunch':>10} {'target':>8}"]
    lines += [f"{name:<42} {t:>8.3f} {t / relaunch:>10.3f} {target:>8}" for name, t, target in rows]
    lines.append(f"  (relaunch = stop {m['stop']:.2f} s + start to ready {m['start']:.2f} s, of which the launcher and "
                 f"interpreters {m['to_python']:.2f} s, imports and building the run with the checkpoint loaded "
                 f"{m['to_built']:.2f} s)")
    lines.append(f"  (rewinds: the median of {len(m['disk'])} and of {len(m['snapshot'])}; each, disk: "
                 f"{', '.join(f'{x:.3f}' for x in m['disk'])}; snapshot: {', '.join(f'{x:.3f}' for x in m['snapshot'])})")
    lines.append(f"snapshot host memory {m['snapshot_bytes'] / 2**20:.1f} MiB = "
                 f"{m['snapshot_bytes'] / m['checkpoint_bytes']:.2f} x the checkpoint on disk "
                 f"({m['checkpoint_bytes'] / 2**20:.1f} MiB)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--worker", choices=("live", "resume"))
    p.add_argument("--resume", default="")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    if args.worker == "live":
        return live_worker(args)
    if args.worker == "resume":
        return resume_worker(args)
    keep = bool(args.out)
    args.out = args.out or tempfile.mkdtemp(prefix="bench-rewind-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        print(table(measure(args), args))
    finally:
        if not keep:
            shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
