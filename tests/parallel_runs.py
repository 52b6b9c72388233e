"""Helpers of the tp / pp tests: run tests/scripts/parallel_layout.py under a layout and read
what it reports and writes. Not a test module."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from control_runs import task_files
from dist_utils import SCRIPTS, parse_results, run_deepspeed

STEPS, CHAT_STEP, CKPT_STEP = 8, 1, 4
LOSS_RTOL = 2e-3  # tp reorders the sums of each matmul; pp runs the very same kernels


def data_files(root: Path) -> str:
    files = task_files(root)
    return json.dumps({"train": files["train"], "eval": files["eval"]})


def run_layouts(layouts: str, out: Path, data: str, resume: str = "", cache: str = "") -> dict[str, list[dict]]:
    """layout -> its ranks' reports (sorted by rank), of one launch of the layout script running
    the comma-separated `layouts` (one world size) one after the other, each in `out`/<layout>;
    the layouts in `resume` are resumed from their step-CKPT_STEP checkpoint in the same launch
    (reported as "<layout>-resumed")."""
    names = layouts.split(",")
    nproc = {"single": 1, "dp2_tp2": 4, "dp2_pp2": 4}.get(names[0], 2)
    args = ["--layouts", layouts, "--out", str(out), "--data", data, "--steps", str(STEPS),
            "--chat-step", str(CHAT_STEP), "--ckpt-step", str(CKPT_STEP), "--resume", resume]
    proc = run_deepspeed(SCRIPTS / "parallel_layout.py", nproc=nproc, args=args, timeout=900,
                         env={"LIVETUNE_CACHE": cache} if cache else None)
    results = parse_results(proc)
    by_layout = {name: sorted((r for r in results if r["layout"] == name), key=lambda r: r["rank"])
                 for name in names + [f"{n}-resumed" for n in filter(None, resume.split(","))]}
    for name, ranks in by_layout.items():
        assert [r["rank"] for r in ranks] == list(range(nproc)), (name, [r["rank"] for r in ranks])
    return by_layout


def losses_of(report: dict) -> list[float]:
    return [report["losses"][str(s)] for s in sorted(map(int, report["losses"]))]


def assert_close_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want), 1):
        assert abs(g - w) <= LOSS_RTOL * abs(w), f"step {step}: {g} vs one rank {w}\n{got}\n{want}"


def assert_learns(losses: list[float]) -> None:
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses


def hf_logits(model_dir: Path, saved: Path, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of the saved Hugging Face folder loaded with from_pretrained, optionally with its
    weights scaled, on the prompts of `saved`; the engine's logits stored in `saved`)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
    record = torch.load(saved)
    with torch.no_grad():
        logits = model(input_ids=record["input_ids"], attention_mask=record["attention_mask"],
                       use_cache=False).logits
    return logits, record["logits"]
