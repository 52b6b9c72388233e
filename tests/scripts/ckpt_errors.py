"""One rank, no launcher: a wrong layout, missing files, a corrupt file and an unfinished
checkpoint each give their own error and change nothing; saving and loading through fsspec's
memory file system works end to end. Reports the error messages."""

import argparse
import shutil
from pathlib import Path

import torch

from ckpt_common import make_task, overrides, report


def fingerprint(trainer) -> float:
    return float(sum(p.double().sum() for p in trainer.engine.module.parameters()))


def attempt(trainer, path: str) -> dict:
    """Load a checkpoint that must fail; say how, and whether anything changed."""
    before, state = fingerprint(trainer), trainer.state.to_dict()
    try:
        trainer.load_checkpoint(path)
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": type(e).__name__, "message": str(e),
                "unchanged": fingerprint(trainer) == before and trainer.state.to_dict() == state}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    from contract.config.load import load_config
    from engine.trainer import Trainer

    out = Path(a.out)
    task = make_task(out / "task")
    base = [o for o in overrides(task, a.out, "one", 0, ["max_steps=2", "train.grad_accum=1"]) if o != "nproc=2"]
    trainer = Trainer(config=load_config(overrides=base))
    trainer.train()
    good = out / "good"
    trainer.save_checkpoint(str(good))
    results = {}
    for case, damage in (("missing", lambda d: (d / "rng" / "rank00000.pt").unlink()),
                         ("corrupt", _flip_bytes),
                         ("unfinished", lambda d: (d / "COMPLETE.json").unlink())):
        broken = out / case
        shutil.copytree(good, broken)
        damage(broken)
        results[case] = attempt(trainer, str(broken))
    # fsspec's in-memory file system: training state and model, out and back in
    saved = fingerprint(trainer)
    trainer.save_checkpoint("memory://ckpt/step-2")
    trainer.save_model("memory://ckpt/model")
    trainer.train_fn(trainer, [next(iter(trainer.train_loader(0)))])  # one more step: weights move
    moved = fingerprint(trainer)
    trainer.load_checkpoint("memory://ckpt/step-2")
    restored = fingerprint(trainer)
    trainer.load_model("memory://ckpt/model")
    results["memory"] = {"saved": saved, "moved": moved, "restored": restored, "after_model": fingerprint(trainer),
                         "listing": sorted(Path(x).name for x in _memory_ls("/ckpt/step-2"))}
    saved_fp = _fingerprint_of(good)
    trainer.close()
    other = Trainer(config=load_config(overrides=[*base, "zero_stage=2", "run_name=two"]))
    results["layout"] = attempt(other, str(good))
    results["good_untouched"] = _fingerprint_of(good) == saved_fp
    report(**results)


def _flip_bytes(folder: Path) -> None:
    target = folder / "global_step2" / "mp_rank_00_model_states.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte different
    target.write_bytes(bytes(data))


def _fingerprint_of(folder: Path) -> dict:
    from engine.checkpoint.locations import file_digest
    return {str(p.relative_to(folder)): file_digest(p) for p in folder.rglob("*") if p.is_file()}


def _memory_ls(path: str) -> list[str]:
    import fsspec
    return fsspec.filesystem("memory").ls(path, detail=False)


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
