"""Golden losses: a short fp32 run of the embedded default, through the real entry point, must give
the loss at every step that the code gave before the redesign.

The run is the one a user gets from `./launch.sh train` with the embedded default preset, made
short: the worker (`python -m engine.worker --run-dir RUN`) under DeepSpeed's launcher, reading
the run folder's config.yaml, writing events.jsonl. The reference values were recorded once, from
commit d50c699 (before any engine refactor), by running this file as a script in a worktree of
that commit:

    git worktree add /tmp/golden d50c699 && cp tests/test_golden_losses.py /tmp/golden/tests/
    cd /tmp/golden && /path/to/.venv/bin/python tests/test_golden_losses.py

Two comparisons (docs/testing.md, "Exact and within a tolerance"):

- On a machine with a record in tests/golden_losses_by_cpu.json (same CPU model, ISA, torch and
  DeepSpeed versions): `==`. fp32 on CPU with a fixed seed, thread count and data order is
  bitwise deterministic on one machine, so any difference means the computation changed.
  `python tests/test_golden_losses.py --record` writes this machine's record, after checking
  the run against the reference within the tolerance below.
- Against the reference (recorded on another CPU): within GOLDEN_ULPS_PER_STEP ulps of fp32 per
  step. Another CPU's kernels (vector width, FMA, MKL/oneDNN paths) sum in another order: the
  loss, a mean of positive token losses, differs by a few ulps (measured: at most 2), and when
  the weights' updates differ too the difference can grow with each step. A real change of the
  training maths moves the losses by 1e-4 or more from the second step on.

Change the numbers only for a deliberate change of the training maths, and say so in the
commit. (Done once: the 2-rank numbers for the token-weighted objective; the old ones stay as
the golden of train.loss_average=micro_batch.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.presets import DEFAULT

pytestmark = pytest.mark.slow  # engine processes: the slow tier

REPO = Path(__file__).resolve().parents[1]
STEPS = 16

# The short run: the embedded default preset with fewer, smaller steps and nothing but training.
OVERRIDES = [f"max_steps={STEPS}", "batch_size=16", "precision=fp32", "seed=1234",
             "optim.warmup_steps=4", "eval.every_n_steps=0", "eval.at_end=false",
             "checkpoint.save_at_end=false", "logging.tensorboard=false",
             "logging.progress_bar=false", "control.enabled=false"]

# Recorded from d50c699 (see the module docstring); float repr round-trips exactly.
GOLDEN_1_RANK: list[float] = [
    4.620299816131592, 4.569674491882324, 4.351891040802002, 4.236917495727539,
    4.000974178314209, 3.9026613235473633, 3.7495338916778564, 3.604919672012329,
    3.6788547039031982, 3.6079399585723877, 3.544457197189331, 3.4653611183166504,
    3.4425861835479736, 3.6172454357147217, 3.363109588623047, 3.434185743331909]
# Re-recorded on 2026-12-03 when the token-weighted objective became the default:
# with 2 ranks the step's loss now weighs each rank's micro-batch by its label tokens (the sum of
# the token losses over both ranks / their count) instead of averaging the two ranks' means. The
# 1-rank run (one micro-batch per step) is the same objective either way and kept its numbers.
GOLDEN_2_RANKS_ZERO2: list[float] = [
    4.595468997955322, 4.60819935798645, 4.297887086868286, 4.112255215644836,
    4.044369339942932, 4.0306291580200195, 3.823198437690735, 3.598539710044861,
    3.545666217803955, 3.5374577045440674, 3.4534441232681274, 3.41131329536438,
    3.4312950372695923, 3.387442469596863, 3.409571647644043, 3.3876789808273315]
# The 2-rank numbers recorded from d50c699: train.loss_average=micro_batch must still give them.
GOLDEN_2_RANKS_ZERO2_MICRO_BATCH: list[float] = [
    4.5954673290252686, 4.609912633895874, 4.298072576522827, 4.111181020736694,
    4.045067310333252, 4.0310959815979, 3.823759078979492, 3.59753155708313,
    3.5441356897354126, 3.538621425628662, 3.453018069267273, 3.41089129447937,
    3.423117756843567, 3.3880865573883057, 3.409363865852356, 3.3869518041610718]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_short_default(root: Path, cache: Path, nproc: int, zero_stage: int = 0,
                      loss_average: str = "tokens") -> list[float]:
    """Run the short default on `nproc` ranks with the real worker; the per-step train losses."""
    cfg = load_config(data=json.loads(json.dumps(DEFAULT)), overrides=[
        *OVERRIDES, f"nproc={nproc}", f"zero_stage={zero_stage}", f"train.loss_average={loss_average}",
        f"output_dir={root}", "run_name=golden"])
    run_dir = root / "golden"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "--num_gpus", str(nproc),
           "--module", "engine.worker", "--run-dir", str(run_dir)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1",  # the thread count changes fp32 reduction order: fix it
           "LIVETUNE_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300, start_new_session=True)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("*.log")))
    assert proc.returncode == 0, f"the run failed ({proc.returncode})\n{proc.stdout[-3000:]}\n{logs}"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    train = [e for e in events if e.get("type") == "train"]
    assert [e["step"] for e in train] == list(range(1, STEPS + 1)), train
    return [e["loss"] for e in train]


GOLDEN_ULPS_PER_STEP = 4  # the tolerance against another CPU's numbers: 4 ulps at step 1, 64 at step 16
RECORDS = Path(__file__).with_name("golden_losses_by_cpu.json")  # exact records, by machine
# The environment variables that choose the CPU kernels (they are part of a machine's key)
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")


def machine_key() -> str:
    """What decides the fp32 bits of a run: the CPU (vendor, family, model, stepping), the ISA
    torch dispatches to, the kernel-choosing environment, torch and DeepSpeed versions."""
    import deepspeed
    import torch
    cpu: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("vendor_id", "cpu family", "model", "stepping"):
            cpu.setdefault(name.strip(), value.strip())
        if not line.strip() and cpu:
            break  # the first processor is enough
    env = "".join(f"; {k}={os.environ[k]}" for k in KERNEL_ENV if k in os.environ)
    return (f"{cpu.get('vendor_id')} family {cpu.get('cpu family')} model {cpu.get('model')} "
            f"stepping {cpu.get('stepping')}; {torch.backends.cpu.get_cpu_capability()}; "
            f"torch {torch.__version__}; deepspeed {deepspeed.__version__}{env}")


def machine_record() -> dict[str, list[float]] | None:
    """This machine's exact losses by golden name, if recorded (None: compare with the tolerance only)."""
    records = json.loads(RECORDS.read_text()) if RECORDS.exists() else {}
    return records.get(machine_key(), {}).get("losses")


def within_fp32(got: list[float], golden: list[float]) -> list[str]:
    """The steps whose loss is further from the golden one than GOLDEN_ULPS_PER_STEP ulps per step
    (an ulp of fp32 at the golden value: 2**-22 for a loss in [2, 4), 2**-21 in [4, 8))."""
    import numpy as np
    return [f"  step {i}: got {g!r}, golden {w!r} (diff {g - w:+.3e}, "
            f"{abs(g - w) / float(np.spacing(np.float32(w))):.1f} ulps, allowed {GOLDEN_ULPS_PER_STEP * i})"
            for i, (g, w) in enumerate(zip(got, golden), start=1)
            if abs(g - w) > GOLDEN_ULPS_PER_STEP * i * float(np.spacing(np.float32(w)))]


def _compare(got: list[float], name: str) -> None:
    golden = globals()[name]
    assert len(got) == len(golden)
    far = within_fp32(got, golden)
    assert not far, "the fp32 losses of the short default run changed beyond fp32 rounding:\n" + "\n".join(far)
    exact = (machine_record() or {}).get(name)
    if exact is not None:  # recorded on this very machine: bit for bit
        diffs = [f"  step {i}: got {g!r}, recorded {w!r}" for i, (g, w) in enumerate(zip(got, exact), 1) if g != w]
        assert not diffs, (f"the fp32 losses differ from this machine's record ({machine_key()}) in "
                           f"{RECORDS.name}:\n" + "\n".join(diffs))
    assert got[-1] < got[0] * 0.8  # it also learns (4.6 -> 3.4)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("livetune-cache")  # the default assets, built fresh


def test_one_rank_fp32_losses_are_golden(tmp_path, cache):
    _compare(run_short_default(tmp_path, cache, nproc=1), "GOLDEN_1_RANK")


@pytest.mark.slow
@pytest.mark.parametrize("loss_average, golden", [
    ("tokens", "GOLDEN_2_RANKS_ZERO2"), ("micro_batch", "GOLDEN_2_RANKS_ZERO2_MICRO_BATCH")])
def test_two_ranks_zero2_fp32_losses_are_golden(tmp_path, cache, loss_average, golden):
    _compare(run_short_default(tmp_path, cache, nproc=2, zero_stage=2, loss_average=loss_average), golden)


CELLS = (("GOLDEN_1_RANK", 1, 0, "tokens"), ("GOLDEN_2_RANKS_ZERO2", 2, 2, "tokens"),
         ("GOLDEN_2_RANKS_ZERO2_MICRO_BATCH", 2, 2, "micro_batch"))


def record(write: bool) -> None:
    """Run each cell twice; print its losses, whether the two runs agree to the bit, and how far
    they are from the golden ones. `write`: store them as this machine's record (only if both runs
    agree and lie within the tolerance of the golden losses)."""
    import tempfile
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for name, nproc, stage, average in CELLS:
            runs = [run_short_default(base / f"{name}-{i}", base / "cache", nproc, stage, average) for i in range(2)]
            far = within_fp32(runs[0], globals()[name])
            print(f"{name} = {runs[0]!r}\n# repeat identical: {runs[0] == runs[1]}; beyond the tolerance: "
                  + ("\n".join(far) or "none"))
            if runs[0] != runs[1] or far:
                write = False
            losses[name] = runs[0]
    if write:
        records = json.loads(RECORDS.read_text()) if RECORDS.exists() else {}
        records[machine_key()] = {"losses": losses}
        RECORDS.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        print(f"recorded in {RECORDS} as {machine_key()!r}")
    elif "--record" in sys.argv:
        print("not recorded: the runs disagree or lie beyond the tolerance")


if __name__ == "__main__":  # the losses of this machine, twice each; --record: store them as its record
    record("--record" in sys.argv)
