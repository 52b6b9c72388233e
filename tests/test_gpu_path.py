"""The parts of the GPU path that can be checked without a GPU: the process group's backend, the
attention option (config -> pre-flight -> the built model) and the memory monitor's numbers."""

from __future__ import annotations

import os
from pathlib import Path

from contract.config.load import load_config
from contract.preflight import preflight


def test_backend_is_gloo_on_cpu_and_nccl_with_gloo_for_cpu_tensors_on_gpus():
    from engine.assembly.process import backend_for
    assert backend_for(False) == "gloo"
    # NCCL alone refuses the loop's CPU-tensor collectives once there are two ranks
    assert backend_for(True) == "cpu:gloo,cuda:nccl"


def test_a_rank_without_a_gpu_of_its_own_is_named(monkeypatch):
    import pytest
    import torch

    from engine.assembly.process import device_of
    assert device_of(0) == torch.device("cpu")
    # no GPU here: the two facts device_of reads are what a 1-GPU machine would say
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"parallel.nproc: local rank 1 has no GPU of its own: 1 GPU visible"):
        device_of(1)


def _attention_problems(*overrides: str) -> list[str]:
    report = preflight(load_config(overrides=["max_steps=2", *overrides]))
    return [m for k, m in report.problems if k == "model.attn_implementation"]


def test_preflight_names_the_missing_flash_attn_package():
    assert _attention_problems() == []  # sdpa, the default, needs nothing
    found = _attention_problems("model.attn_implementation=flash_attention_2")
    assert len(found) == 1 and "flash_attn package" in found[0] and "pip install flash-attn" in found[0]


def test_preflight_goes_by_the_installed_package_and_refuses_fp32(tmp_path: Path, monkeypatch):
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _attention_problems("model.attn_implementation=flash_attention_2") == []
    found = _attention_problems("model.attn_implementation=flash_attention_2", "precision=fp32")
    assert len(found) == 1 and "bf16 or fp16" in found[0]


def test_the_built_model_uses_the_configured_attention(tmp_path: Path):
    from transformers import LlamaConfig

    from engine.model.loading import build_model
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=32).save_pretrained(tmp_path)
    for attn in ("eager", "sdpa"):
        model = build_model(tmp_path, seed=0, precision="fp32", attn_implementation=attn)
        assert model.config._attn_implementation == attn


def test_memory_monitor_reports_the_peak_rss_on_cpu():
    import psutil

    from engine.monitors import MemoryMonitor, StepInfo
    ballast = bytearray(64 * 2**20)  # a peak that is gone by the time it is read
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    del ballast
    record = MemoryMonitor().measure(None, StepInfo(step=1, epoch=0, loss=1.0, tokens=1, step_time=1.0))
    rss = psutil.Process(os.getpid()).memory_info().rss / 2**20
    assert set(record) == {"mem_mb", "mem_peak_mb"}
    assert abs(record["mem_mb"] - rss) < 32
    assert record["mem_peak_mb"] >= record["mem_mb"] + 32
