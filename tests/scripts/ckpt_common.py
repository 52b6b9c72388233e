"""Shared by the checkpoint test scripts: a small task with epochs of a few steps, a tiny model
with dropout (so that the RNG streams matter), and a run config for 2 ranks. Not a test module."""

from __future__ import annotations

import fcntl
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402,F401  (re-exported for the scripts)


def make_task(root: Path, train_rows: int = 48, eval_rows: int = 16, dropout: float = 0.1) -> dict:
    """A model folder (the default tiny Llama's config with dropout, fp32) and small data files,
    the instruction rows and the same rows as preference pairs (`pairs_train`, `pairs_eval`);
    returns their paths."""
    from engine.data.default_task import default_root, ensure_default_assets, preference_row

    assets = ensure_default_assets(default_root())
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    # every rank of a launch makes the task: one at a time, and only what is not there yet (a
    # second rank copying the folder beside the first failed with FileExistsError)
    with open(root / ".making", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not model.exists():
            shutil.copytree(assets.model_dir, model)
            config = json.loads((model / "config.json").read_text())
            config.update(attention_dropout=dropout, dtype="float32")
            (model / "config.json").write_text(json.dumps(config))
        if not (root / "eval.jsonl").exists():
            rows = assets.train_path.read_text().splitlines()
            (root / "train.jsonl").write_text("\n".join(rows[:train_rows]) + "\n")
            evals = assets.eval_path.read_text().splitlines()
            (root / "eval.jsonl").write_text("\n".join(evals[:eval_rows]) + "\n")
        if not (root / "eval.pairs.jsonl").exists():  # the same rows as preference pairs
            for name in ("train", "eval"):
                rows = (root / f"{name}.jsonl").read_text().splitlines()
                pairs = [json.dumps(preference_row(json.loads(r))) for r in rows]
                (root / f"{name}.pairs.jsonl").write_text("\n".join(pairs) + "\n")
    return {"model": str(model), "train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"),
            "pairs_train": str(root / "train.pairs.jsonl"), "pairs_eval": str(root / "eval.pairs.jsonl")}


def overrides(task: dict, out: str, name: str, zero: int, extra: list[str] = ()) -> list[str]:
    """2 ranks x micro-batch 4 x grad_accum 2 over 48 rows: 3 steps per epoch, 3 epochs."""
    return [f"model.path={task['model']}", f"data.train={task['train']}", f"data.eval={task['eval']}",
            f"zero_stage={zero}", "nproc=2", "epochs=3", "batch_size=4", "train.grad_accum=2",
            "data.max_length=32", "lr=3e-3", "optim.warmup_steps=2", "precision=fp32",
            "eval.at_end=false", "eval.batch_size=8", "checkpoint.save_at_end=false",
            "checkpoint.keep_last=0", "control.enabled=false", "logging.tensorboard=false",
            f"output_dir={out}", f"run_name={name}", *extra]
