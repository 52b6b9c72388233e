"""Exact resume on 2 ranks under ZeRO 0, 2 and 3 with gradient accumulation 2 and dropout: a run
resumed from step k (mid-epoch, and at an epoch boundary) produces the very same per-step losses
for steps k+1..n as the uninterrupted run. The same runs check the exports: under ZeRO-3 the
saved model loads with `from_pretrained` and gives the engine's logits, the DeepSpeed part of
the checkpoint stays readable by zero_to_fp32, and the export loads back into the engine; under
ZeRO-2 a sharded export loads back and the best checkpoint's weights reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_utils import SCRIPTS, parse_results, run_deepspeed


STAGES = (0, 2, 3)


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> dict[int, tuple[Path, dict]]:
    """One launch for the three stages (a 2-rank start costs more than their steps): each stage
    trains, exports and resumes in its own Trainers and folder `zeroN`, one after the other."""
    root = tmp_path_factory.mktemp("resume")
    proc = run_deepspeed(SCRIPTS / "ckpt_resume.py", nproc=2,
                         args=("--zero", *map(str, STAGES), "--out", str(root)), timeout=1500)
    results = parse_results(proc)
    by_stage = {}
    for zero in STAGES:
        ranks = sorted((r for r in results if r["zero"] == zero), key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1]
        assert ranks[0]["full"] == ranks[1]["full"]
        by_stage[zero] = (root / f"zero{zero}", ranks[0])
    return by_stage


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("zero", STAGES)
def test_resumed_runs_repeat_the_uninterrupted_losses(stages, zero):
    tmp_path, r = stages[zero]
    full = r["full"]
    assert len(full) == 9 and full[-1] < full[0]
    # every 4 steps and at each epoch end (3 steps per epoch), and the last step
    assert r["checkpoints"] == ["step-3", "step-4", "step-6", "step-8", "step-9"]
    assert r["step-4"]["position"] == {"epoch": 1, "batch_in_epoch": 2, "global_step": 4, "total_steps": 9}
    assert r["step-6"]["position"] == {"epoch": 2, "batch_in_epoch": 0, "global_step": 6, "total_steps": 9}
    assert r["step-4"]["losses"] == full[4:]  # bit for bit, mid-epoch
    assert r["step-6"]["losses"] == full[6:]  # bit for bit, from an epoch boundary
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    resumes = [e for e in events if e["type"] == "resume"]
    assert [e["step"] for e in resumes] == [4, 6] and resumes[0]["config_changes"] == []
    if zero == 3:
        check_zero3_export(tmp_path, r)
    if zero == 2:
        assert r["shards"] > 1 and r["sharded_diff"] == 0.0
        assert r["best"] == min(("step-4", "step-6", "step-8"), key=lambda n: metric(tmp_path, n))
        assert r["best_reloaded"] == r["best_recorded"]  # the very weights that were evaluated


def metric(tmp_path: Path, name: str) -> float:
    marker = json.loads((tmp_path / "run" / "checkpoints" / name / "COMPLETE.json").read_text())
    return marker["metrics"]["eval/loss"]


def check_zero3_export(tmp_path: Path, r: dict) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert r["scrambled_diff"] > 0.1 and r["reloaded_diff"] == 0.0  # load_model restored the export
    export = tmp_path / "export"
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    AutoTokenizer.from_pretrained(str(export))
    reference = torch.load(tmp_path / "reference.pt")
    with torch.no_grad():
        logits = model(input_ids=reference["ids"]).logits
    assert model.dtype == torch.float32
    assert (logits - reference["logits"]).abs().max().item() < 1e-5
    # DeepSpeed's own tool reads the training checkpoint of the last step: the exported weights
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "run" / "checkpoints" / "step-9"))
    saved = load_file(str(export / "model.safetensors"))
    assert set(saved) <= set(fp32)
    for key, tensor in saved.items():
        assert torch.equal(fp32[key], tensor), key
