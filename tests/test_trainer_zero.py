"""Our Trainer on 2 ranks under ZeRO 0, 1, 2 and 3: the loss goes down; ZeRO-3 partitions."""

import pytest

from dist_utils import SCRIPTS, parse_results, run_deepspeed


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_ranks_learn(tmp_path, zero):
    proc = run_deepspeed(SCRIPTS / "train_zero.py", nproc=2, args=("--zero", str(zero), "--out", str(tmp_path)),
                         timeout=600)
    results = sorted(parse_results(proc), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    losses = results[0]["losses"]
    assert len(losses) == 40
    assert results[1]["losses"] == losses  # the logged loss is the data-parallel mean, same everywhere
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    for r in results:
        share = r["held"] / r["total"]
        if zero == 3:
            assert 0.4 < share < 0.6, share  # about half the parameters on each rank
        else:
            assert share == 1.0
