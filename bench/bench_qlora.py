"""LoRA on a bf16 base vs on a 4-bit and an 8-bit base (QLoRA): the model's own footprint, the
process's peak memory and the step time, each base in a fresh process.

    .venv/bin/python bench/bench_qlora.py                 # the Llama 0.5B shape, 4 layers (CPU)
    .venv/bin/python bench/bench_qlora.py --layers 24     # the whole shape (a GPU)

The model is built by the engine's own code (engine.model.loading.build_model with the run
config's quantization, engine.model.methods.PeftMethod.prepare_model: prepare_model_for_kbit_training
and LoRA on every linear layer of the blocks), then trained with AdamW on the adapter in a plain
torch loop (no DeepSpeed engine: its buffers would blur the comparison of the bases).

What the numbers mean:
- footprint: transformers' `get_memory_footprint()`, the bytes of the model's parameters and
  buffers (packed 4-bit / int8 weights with their quantization constants);
- peak RSS: the process's peak resident set (`ru_maxrss`): every page it touched, the Python
  runtime and torch's libraries included (about 0.4-0.6 GiB here), and the freshly written weights
  it read while loading (the weight file's pages count when mapped);
- CUDA peak: `torch.cuda.max_memory_allocated()`, on a GPU only.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(quantization: str, layers: int, steps: int, seq: int, batch: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from contract.config.load import load_config
    from engine.model.loading import build_model, quantization_config
    from engine.model.methods import PeftMethod

    cuda = torch.cuda.is_available()
    precision = "bf16"
    shape = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        LlamaForCausalLM(shape).to(torch.bfloat16).save_pretrained(folder)
        cfg = load_config(overrides=[f"model.path={folder}", "method=lora", "method.lora_r=16",
                                     f"model.quantization={quantization}", "model.bnb_4bit_compute_dtype=bf16"])
        model = build_model(folder, seed=0, precision=precision, quantization=quantization_config(cfg.model, precision))
        if cuda and quantization == "none":
            model = model.cuda()
        model = PeftMethod("lora").prepare_model(model, cfg)
    footprint = model.get_base_model().get_memory_footprint()
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, shape.vocab_size, (batch, seq), device=device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    result = {"quantization": quantization, "footprint_mib": footprint / 2**20,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "step_s": sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0],
              "loss": float(loss)}
    if cuda:
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers (the 0.5B shape has 24)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one base
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.layers, a.steps, a.seq, a.batch)))
        return
    rows = []
    for quantization in ("none", "4bit", "8bit"):
        out = subprocess.run([sys.executable, __file__, "--one", quantization, "--layers", str(a.layers),
                              "--steps", str(a.steps), "--seq", str(a.seq), "--batch", str(a.batch)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"Llama, hidden 1024, {a.layers} layers, vocab 32000; LoRA r 16; batch {a.batch} x {a.seq} tokens")
    print("| base | footprint MiB | peak RSS MiB | step s | CUDA peak MiB | peak vs bf16 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        peak = r.get("cuda_peak_mib", r["peak_rss_mib"])
        ref = base.get("cuda_peak_mib", base["peak_rss_mib"])
        name = "bf16" if r["quantization"] == "none" else r["quantization"]
        print(f"| {name} | {r['footprint_mib']:.0f} | {r['peak_rss_mib']:.0f} | {r['step_s']:.2f} | "
              f"{r.get('cuda_peak_mib', float('nan')):.0f} | {peak / ref:.2f}x |")


if __name__ == "__main__":
    main()
