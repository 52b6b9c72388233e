"""bench/gpu.py keeps working: its tiny shapes run on CPU through every case (ours full with chats,
ours LoRA, the HF Trainer's two) and print the whole table with sane numbers. One model shape:
the two shapes differ only in their config's numbers, and each shape costs three process starts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROWS = ("full", "hf-full", "lora", "hf-lora", "chat-idle", "chat-mid")


@pytest.mark.slow
def test_gpu_bench_tiny_prints_every_row(tmp_path: Path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--tiny", "--models", "Qwen2-0.5B",
                           "--json", str(out), "--out", str(tmp_path / "runs"), "--total-seconds", "850"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]["Qwen2-0.5B"]}
    assert set(rows) == set(ROWS), proc.stdout[-3000:]
    assert not [r for r in rows.values() if "error" in r], proc.stdout[-3000:]
    for case in ("full", "hf-full", "lora", "hf-lora"):
        r = rows[case]
        assert r["tokens_per_s"] > 0 and math.isfinite(r["tokens_per_s"])
        assert r["peak_mib"] > 50 and r["steps"] >= 1
        assert "mfu" not in r  # no GPU, no peak: the table says n/a
    assert rows["lora"]["trainable"] < rows["full"]["trainable"] == rows["full"]["parameters"]
    assert rows["hf-lora"]["trainable"] == rows["lora"]["trainable"]  # the same adapter
    assert rows["hf-full"]["parameters"] == rows["full"]["parameters"]
    for case in ("full", "lora"):
        assert rows[case]["x_hf"] == pytest.approx(rows[case]["tokens_per_s"] / rows[f"hf-{case}"]["tokens_per_s"])
    for case in ("chat-idle", "chat-mid"):
        assert rows[case]["first_token_s"] > 0 and rows[case]["tokens"] > 0
    assert rows["chat-mid"]["delay_s"] is not None
    table = [line for line in proc.stdout.splitlines() if line.startswith("| Qwen2-0.5B |")]
    assert len(table) == len(ROWS) and "peak used for MFU: n/a" in proc.stdout
