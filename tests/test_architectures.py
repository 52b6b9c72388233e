"""The architecture matrix (issue 16 §4): GPT-2 (Conv1D layers), Qwen2 (attention biases), Mistral
(sliding window), Phi-3 (fused qkv and gate_up projections), GPT-NeoX, OPT, Gemma and Llama, each
built tiny from its config (hidden 32, 2 layers, no hub), trained by our Trainer on one process
with full fine-tuning and with LoRA (12 steps each, loss going down). LoRA's targets are chosen by
module type: every nn.Linear / Conv1D of the blocks, attention and MLP, never the embeddings or
the output head. The saved adapter loads back with peft and gives the trained model's logits.

One process runs the whole matrix (tests/scripts/architectures.py); each architecture is its own
test over that run's report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "architectures.py"

ATTENTION_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPECTED = {  # the linear layers of one block, by their short names
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "qwen2": ATTENTION_MLP,
    "mistral": ATTENTION_MLP,
    "phi3": ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "opt": ["k_proj", "v_proj", "q_proj", "out_proj", "fc1", "fc2"],
    "gemma": ATTENTION_MLP,
    "llama": ATTENTION_MLP,
}
PER_BLOCK = {"gpt2": 4}  # GPT-2's attention and MLP both have a c_proj
HEADS = ("lm_head", "embed_out", "wte", "embed_tokens", "project_in", "project_out")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("architectures")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(work), *EXPECTED], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    found = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and found, proc.stdout[-3000:]
    return {r["arch"]: r for r in found}


def _down(losses: list[float]) -> bool:
    return len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_architecture_trains_full_and_lora_and_the_adapter_reloads(reports, arch):
    r = reports[arch]
    assert "error" not in r, r.get("error")
    # LoRA's targets: every linear layer of the blocks, named so that peft catches nothing else
    assert sorted(r["targets"]) == sorted(EXPECTED[arch])
    assert r["logged_targets"] == sorted(EXPECTED[arch]) and r["loss_average"] == "tokens"  # the run log says so
    wrapped = {name.rsplit(".", 1)[-1] for name in r["wrapped"]}
    per_block = PER_BLOCK.get(arch, len(EXPECTED[arch]))
    assert wrapped == set(EXPECTED[arch]) and len(r["wrapped"]) == 2 * per_block  # 2 blocks
    assert not any(part in HEADS for name in r["wrapped"] for part in name.split("."))
    assert _down(r["full"]), r["full"]
    assert _down(r["lora"]), r["lora"]
    # the adapter saved by the trainer, loaded by peft onto a fresh base model: the trained logits
    assert r["logits_diff"] < 1e-5 and r["base_diff"] > 1e-3, r
