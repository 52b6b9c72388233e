"""Rewind, branch and snapshot in place, through the control plane's real path (rank 0's command
queue -> the step-boundary broadcast -> every rank's handler), under several layouts one after
the other in one launch. Each layout's run (9 steps: 3 epochs of 3, dropout on, grad_accum 2):

    step 2: snapshot s2;  step 4: the schedule saves step-4 (and step-8 later)
    step 6: rewind to s2          -> steps 3..6 again
    step 6 (again): rewind to 4   -> steps 5..6 again, then 7, 8
    step 8: branch b from step-4  -> steps 5..9 on branch b
    step 9: branch c from step-8 (b's) with lr_scale 0.5 -> step 9 on c; then `branches`
plus refusals at step 1: an unknown checkpoint, a taken branch name, a checkpoint of another
layout (the previous layout's step-4). The first layout's commands go through RunClient over
the control socket (rewind / branch / snapshot methods), the others straight into rank 0's queue.
Prints per rank the (step, loss, lr) sequence, the replies and the branch tree. A preference layout
(PAIRS: DPO, full fine-tuning under ZeRO-3, so its frozen reference is a partitioned engine of its
own) trains on the task's pairs and also writes, per rank, each step's reward metrics and a digest
of the reference's weights (and of the policy's before the first step) to a file the result names.
Not a test module (tests/test_rewind.py runs it)."""

import argparse
import hashlib
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckpt_common import make_task, overrides, report  # noqa: E402

LAYOUTS = {"zero0": (0, []), "zero2": (2, []), "zero3": (3, []), "lora": (2, ["method=lora"]),
           "lomo": (0, ["method=lomo", "lr=5e-2", "train.grad_accum=1"]),
           "adalomo": (0, ["method=adalomo", "lr=1e-2", "train.grad_accum=1"]),
           "tp2": (0, ["tp=2"]), "pp2": (0, ["pp=2"]), "dpo": (3, ["objective=dpo", "preference.beta=0.5"])}
PAIRS = {"dpo"}  # the layouts trained on the task's preference pairs


def partition_digest(module) -> str:
    """A digest of this rank's part of `module`'s weights (its ZeRO-3 partitions, as they are)."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode())
        digest.update(getattr(param, "ds_tensor", param).detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def plan(other: str | None) -> dict[int, list]:
    """Commands queued after the n-th step trained (counting repeats)."""
    from contract.protocol.branch_commands import Branch, Branches, Rewind, Snapshot
    first = [Rewind(target="step-99"), Branch(target="step-4", branch="main")]
    if other:
        first.append(Rewind(target=other))
    return {1: first, 2: [Snapshot(snapshot="s2")], 6: [Rewind(target="s2")], 10: [Rewind(target="4")],
            14: [Branch(target="step-4", branch="b")],
            19: [Branch(target="step-8", branch="c", lr_scale=0.5)], 20: [Branches()]}


def send_by_client(run_dir: Path, req: str, cmd, replies: list) -> threading.Thread:
    """Send `cmd` through RunClient's own method for it, in a thread; its answer goes to `replies`."""
    from supervisor.client import CommandError, RunClient

    def send() -> None:
        client = RunClient(run_dir)
        try:
            if cmd.name == "rewind":
                result = client.rewind(cmd.target)
            elif cmd.name == "branch":
                result = client.branch(cmd.target, cmd.branch, **cmd.settings())
            elif cmd.name == "branches":
                result = client.branches()
            else:
                result = client.snapshot(cmd.snapshot)
            replies.append({"type": "done", "id": req, "result": result.wire()})
        except CommandError as e:
            replies.append({"type": "error", "id": req, "message": str(e)})
        finally:
            client.close()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _wait(ready, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError("the client's command was not queued")
        time.sleep(0.01)


def run_layout(name: str, task: dict, out: Path, other: str | None, via_client: bool = False) -> dict:
    from contract.config.load import load_config
    from contract.protocol.commands import Status
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.trainer import Trainer

    zero, extra = LAYOUTS[name]
    if name in PAIRS:
        task = {**task, "train": task["pairs_train"], "eval": task["pairs_eval"]}
    cfg = load_config(overrides=overrides(task, str(out / "runs"), name, zero, [
        *extra, "max_steps=9", "control.enabled=true", "checkpoint.every_n_steps=4", "checkpoint.keep_last=2"]))
    seen: list[list] = []
    # a preference layout: each step's reward metrics, the reference's digest after it, the
    # policy's digest before the first step (the initial model the reference must stay)
    preference: dict[str, list] = {"metrics": [], "reference": [], "initial": []}
    replies: list[dict] = []
    todo = plan(other)

    threads: list[threading.Thread] = []

    class Driver(Callback):
        def on_train_begin(self, trainer):
            if name in PAIRS and not preference["initial"]:
                preference["initial"].append(partition_digest(trainer.engine.module))

        def on_train_batch_end(self, trainer, loss):
            # the loss, and the rate the next step trains with
            seen.append([trainer.state.global_step, loss, trainer.current_lr()])
            if name in PAIRS:
                preference["metrics"].append(dict(trainer.train_fn.metrics))
                preference["reference"].append(partition_digest(trainer.train_fn.reference.model.module))
            if trainer.env.rank != 0:
                return
            for cmd in todo.get(len(seen), []):
                req = f"{len(seen)}-{cmd.name}"
                if via_client:  # over the socket, as a front end sends it; queued before this boundary
                    queued = len(trainer.control.commands)
                    threads.append(send_by_client(trainer.folder.root, req, cmd, replies))
                    _wait(lambda: len(trainer.control.commands) > queued)
                else:
                    trainer.control.commands.put(req, cmd, Reply(req, replies.append, cmd.returns))

    trainer = Trainer(config=cfg, callbacks=[Driver()])
    trainer.train()
    for thread in threads:
        thread.join(timeout=120)
    assert Status  # the module imports cleanly
    result = {"layout": name, "rank": trainer.env.rank, "seen": seen, "folder": str(trainer.folder.root),
              "branch": trainer.folder.branch,
              "replies": [_short(r) for r in replies if r.get("type") in ("done", "error")]}
    if name in PAIRS:  # too long for a result line
        path = out / f"{name}-rank{trainer.env.rank}-preference.json"
        path.write_text(json.dumps(preference))
        result["preference"] = str(path)
    trainer.close()
    return result


def resume_branch(name: str, task: dict, out: Path) -> dict:
    """A new Trainer on the first layout's run folder with resume=main: main's newest checkpoint
    (step-8; the run had left main for branch b there), trained to the end on main again."""
    from contract.config.load import load_config
    from engine.callbacks import Callback
    from engine.trainer import Trainer

    zero, extra = LAYOUTS[name]
    cfg = load_config(overrides=overrides(task, str(out / "runs"), name, zero, [
        *extra, "max_steps=9", "control.enabled=false", "checkpoint.every_n_steps=4", "checkpoint.keep_last=2", "resume=main"]))
    seen: list[list] = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, loss):
            seen.append([trainer.state.global_step, loss])

    trainer = Trainer(config=cfg, callbacks=[Probe()])
    trainer.train()
    result = {"layout": f"{name}-resumed", "rank": trainer.env.rank, "seen": seen,
              "branch": trainer.folder.branch, "checkpoints": str(trainer.folder.checkpoints)}
    trainer.close()
    return result


def _short(reply: dict) -> dict:
    """A reply small enough for a result line."""
    if reply["type"] == "error":
        return {"id": reply["id"], "error": reply["message"][:240]}
    res = reply["result"]
    out = {"id": reply["id"], **{k: res[k] for k in ("step", "from_step", "abandoned", "branch", "parent", "bytes",
                                                     "seconds", "current", "checkpoints", "snapshots") if res.get(k) is not None}}
    if res.get("set"):
        out["set"] = res["set"]["changes"]
    if "tree" in res:
        out["tree"] = {n: [b["parent"], b["fork_step"]] for n, b in res["tree"].items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume-branch", action="store_true", help="then resume=main in the first layout's run")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    task = make_task(out / "task")
    other = None
    for i, name in enumerate(a.layouts.split(",")):
        r = run_layout(name, task, out, other, via_client=i == 0)  # the first through RunClient
        report(**r)
        other = str(Path(r["folder"]) / "checkpoints" / "step-4")
        if i == 0 and a.resume_branch:  # before any tensor-parallel layout (see the test's LAYOUTS)
            report(**resume_branch(name, task, out))


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
