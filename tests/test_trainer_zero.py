"""Our Trainer on 2 ranks under ZeRO 0, 1, 2 and 3: the loss goes down; ZeRO-3 partitions.

The four stages train one after the other in one launch (a 2-rank start costs far more than
40 steps of the tiny model): each stage is its own Trainer, engine and model, and is checked
by its own test."""

import pytest

from dist_utils import SCRIPTS, parse_results, run_deepspeed

STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def by_stage(tmp_path_factory) -> dict[int, list[dict]]:
    out = tmp_path_factory.mktemp("zero")
    proc = run_deepspeed(SCRIPTS / "train_zero.py", nproc=2,
                         args=("--zero", *map(str, STAGES), "--out", str(out)), timeout=900)
    results = parse_results(proc)
    return {z: sorted((r for r in results if r["zero"] == z), key=lambda r: r["rank"]) for z in STAGES}


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("zero", STAGES)
def test_two_ranks_learn(by_stage, zero):
    results = by_stage[zero]
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
