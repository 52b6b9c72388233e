"""Throughput of this Trainer against a bare DeepSpeed loop and the Hugging Face Trainer.

Run by hand:  .venv/bin/python bench/bench_trainer.py [--steps 30] [--stages 2,3] [--repeats 3]
                 [--data uniform,uneven]

Same model (a Llama of hidden 256, 4 layers, saved once with weights), same data, same DeepSpeed
config, 2 ranks (gloo on CPU, nccl on GPU), ZeRO-2 then ZeRO-3. Tokens/s counts real (non-pad)
tokens only, over the steps after a warm-up, wall clock on rank 0. Two data sets: uniform
(every sample 128 tokens) and uneven (lognormal lengths, median 60, at most 256). On uneven
data the Hugging Face Trainer runs twice: its default random sampling and its best setting,
train_sampling_strategy="group_by_length"; this Trainer runs with group_by_length and packing.

Each variant runs `--repeats` times, the plan's order reversed every other round, and the table
gives the median: on a shared machine one run of a variant can be 10% off its neighbour's for
no reason of its own (measured: the same pair of runs gave 0.91 and 1.08 a few minutes apart).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "trainer_worker.py"


def make_data(folder: Path, uneven: bool, n: int = 4096, vocab: int = 2048, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    if uneven:
        lengths = np.clip(rng.lognormal(np.log(60), 0.6, n).astype(int), 8, 256)
    else:
        lengths = np.full(n, 128)
    path = folder / ("uneven.jsonl" if uneven else "uniform.jsonl")
    with open(path, "w") as f:
        for length in lengths:
            f.write(json.dumps({"input_ids": rng.integers(3, vocab, int(length)).tolist()}) + "\n")
    return path


def make_model(folder: Path, vocab: int = 2048) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model_dir = folder / "model"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    save_word_tokenizer(model_dir, vocab)
    return model_dir


def save_word_tokenizer(model_dir: Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` tokens t0..t{vocab-1} (pad, bos, eos, unk first) beside the model."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    words = {f"t{i}": i for i in range(vocab)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t3")),
                                  pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")
    tok.save_pretrained(model_dir)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, zero: int, data: Path, model: Path, steps: int, batching: str, out: Path,
                sets: tuple[str, ...] = ()) -> dict:
    """One variant on 2 ranks; `sets`: config overrides for our Trainer."""
    args = ["--variant", variant, "--zero", str(zero), "--data", str(data), "--model", str(model),
            "--steps", str(steps), "--batching", batching, "--out", str(out), *(f"--set={s}" for s in sets)]
    # a free rendezvous port: DeepSpeed's default (29500) clashes with any other job on the machine
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(WORKER), *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
                          start_new_session=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} zero{zero} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", default="uniform,uneven", help="which data sets (a quick check: uniform)")
    args = parser.parse_args()
    data_sets = set(args.data.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_model(tmp)
        uniform, uneven = make_data(tmp, False), make_data(tmp, True)
        for zero in [int(s) for s in args.stages.split(",")]:
            plan = [("uniform", uniform, "bare", "random"), ("uniform", uniform, "hf", "random"),
                    ("uniform", uniform, "ours", "random"),
                    ("uneven", uneven, "bare", "random"), ("uneven", uneven, "hf", "random"),
                    ("uneven", uneven, "hf", "group_by_length"),
                    ("uneven", uneven, "ours", "group_by_length"), ("uneven", uneven, "ours", "packing")]
            plan = [entry for entry in plan if entry[0] in data_sets]
            runs: dict[tuple[str, str, str], list[float]] = {}
            for rep in range(args.repeats):
                for data_name, path, variant, batching in (plan if rep % 2 == 0 else plan[::-1]):
                    r = run_variant(variant, zero, path, model, args.steps, batching, tmp / "r.json")
                    runs.setdefault((data_name, variant, batching), []).append(r["tokens_per_s"])
                    print(f"zero{zero} {data_name:8s} {variant:5s} {batching:16s} {r['tokens_per_s']:9.0f} tok/s",
                          flush=True)
            results = {key: float(np.median(v)) for key, v in runs.items()}
            for (data_name, variant, batching), tps in results.items():
                bare = results[(data_name, "bare", "random")]
                hf_best = max(v for (d, var, _), v in results.items() if d == data_name and var == "hf")
                rows.append((f"ZeRO-{zero}", data_name, f"{variant} ({batching})", tps, tps / bare, tps / hf_best))
    print("\n| ZeRO | data | loop (batching) | real tokens/s | × bare DeepSpeed | × best HF Trainer |")
    print("|---|---|---|---|---|---|")
    for z, d, v, tps, rb, rh in rows:
        print(f"| {z} | {d} | {v} | {tps:.0f} | {rb:.2f} | {rh:.2f} |")


if __name__ == "__main__":
    main()
