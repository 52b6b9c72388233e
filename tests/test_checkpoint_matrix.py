"""Every layout x method the config accepts loads its own training checkpoints exactly at the
precision a user gets by default (`precision: auto`: bf16 on a CPU with native bf16, else fp32), on 2 ranks
(tests/scripts/ckpt_matrix.py). Each cell trains 4 steps with step-2 saved, is rewound to step-2
in place and must repeat steps 3 and 4 bit for bit; the pipeline cells (whose bf16 optimizer
DeepSpeed saves in one form and loads in another) are also resumed afresh with `resume=`.
fp16 needs a GPU or a CPU with native fp16 (the config refuses it elsewhere), so it is not run here.
"""

from __future__ import annotations

import pytest

from dist_utils import SCRIPTS, default_precision, parse_results, run_deepspeed

# name=zero:method[:tp|pp]; tensor parallelism last: its process-wide groups stay behind it
LAUNCHES = {
    "data-parallel": "zero0=0:full,zero1=1:full,lora2=2:lora,zero3=3:full,lomo0=0:lomo,adalomo2=2:adalomo",
    "split": "pp0=0:full:pp,pp1=1:full:pp,tp1=1:full:tp",
}
RESUMED = {"split": "pp0,pp1"}


@pytest.mark.slow
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_each_cell_reloads_its_checkpoint_exactly_at_the_default_precision(tmp_path, launch):
    cells = [c.split("=")[0] for c in LAUNCHES[launch].split(",")]
    args = ["--cells", LAUNCHES[launch], "--out", str(tmp_path)]
    if launch in RESUMED:
        args += ["--resume", RESUMED[launch]]
    results = parse_results(run_deepspeed(SCRIPTS / "ckpt_matrix.py", nproc=2, args=args, timeout=900))
    for cell in cells:
        ranks = sorted((r for r in results if r["cell"] == cell), key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1], cell
        assert ranks[0]["seen"] == ranks[1]["seen"] and ranks[0]["errors"] == [], (cell, ranks[0]["errors"])
        assert ranks[0]["precision"] == default_precision(), cell  # what `auto` gives this machine
        seen = ranks[0]["seen"]
        assert [s for s, _ in seen] == [1, 2, 3, 4, 3, 4], (cell, seen)
        assert seen[4:] == seen[2:4], f"{cell}: steps 3-4 after the rewind {seen[4:]}, at first {seen[2:4]}"
        if cell in RESUMED.get(launch, ""):
            resumed = [r for r in results if r["cell"] == f"{cell}-resumed"]
            assert len(resumed) == 2 and all(r["seen"] == seen[2:4] for r in resumed), (cell, resumed)


@pytest.mark.parametrize("method", ["lomo", "adalomo"])
def test_a_fused_method_under_zero3_that_would_save_is_refused_before_launch(method):
    """DeepSpeed's ZeRO-3 engine writes its partitioned weights through an optimizer of its own,
    which LOMO and AdaLomo do not have: a schedule of training checkpoints is refused, naming
    what works; ZeRO 3 without one still trains (its model export does not need DeepSpeed's writer)."""
    from contract.config.load import load_config
    base = [f"method={method}", "zero_stage=3", "nproc=2"]
    with pytest.raises(ValueError, match=rf"checkpoint.every_n_epochs: {method} under ZeRO 3 cannot save training "
                       r"checkpoints: .* use zero_stage 0, 1 or 2 for a run that saves training checkpoints"):
        load_config(overrides=[*base, "checkpoint.every_n_epochs=1"])
    load_config(overrides=base)
    load_config(overrides=[f"method={method}", "zero_stage=2", "nproc=2", "checkpoint.every_n_steps=2"])
