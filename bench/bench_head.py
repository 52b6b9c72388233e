"""The output head only at labelled positions (`train.logits_at_labels`) against the head at every
position and against the Hugging Face Trainer, on prompt-masked rows.

Run by hand:  .venv/bin/python bench/bench_head.py [--vocabs 32000,128000] [--shape small|0.5b]
                 [--steps 20] [--repeats 2] [--zero 2] [--chunk-rows 128]

A Qwen2-shaped model (tied embeddings; `small`: hidden 256, 4 layers; `0.5b`: Qwen2-0.5B's
hidden 896, 24 layers, which a 2-core CPU trains slowly) with a wide vocabulary, 2 ranks,
ZeRO-2, the precision a user gets by default (bf16 where the hardware has it), rows of 128
tokens whose first half is the prompt (label -100): half the positions carry a label. Four
loops on the same model, data and DeepSpeed config: the HF Trainer (logits everywhere), ours
with the head everywhere (`train.logits_at_labels=false`), ours with the head at the labelled
positions only, all at once (`train.logits_chunk_rows=0`), and ours with its cross-entropy in
chunks of `--chunk-rows` rows (a micro-batch of 8 rows has 512 labelled positions; the default
chunk of 1024 would take them at once). Printed: real tokens/s over the steps after a warm-up, and the peak
memory of the busiest rank, as ratios against the HF Trainer measured in the same run. On the
CPU the peak is the process's peak RSS: the weights, the optimizer state, activations and the
logits, everything the process touched (the model files are read, not mapped); on a GPU the
CUDA allocator's peak is printed too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainer import run_variant, save_word_tokenizer  # noqa: E402  (2 ranks through the DeepSpeed launcher)

SHAPES = {"small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2),
          "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2)}
LENGTH, PROMPT = 128, 64  # tokens per row; the first PROMPT are the prompt (no label)


def make_model(folder: Path, vocab: int, shape: str) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=True,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, **SHAPES[shape])
    model_dir = folder / f"model-{vocab}"
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    save_word_tokenizer(model_dir, vocab)
    return model_dir


def make_data(folder: Path, vocab: int, n: int = 2048, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path = folder / f"masked-{vocab}.jsonl"
    with open(path, "w") as f:
        for _ in range(n):
            ids = rng.integers(3, vocab, LENGTH).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * PROMPT + ids[PROMPT:]}) + "\n")
    return path


def variants(chunk_rows: int) -> list[tuple[str, str, tuple[str, ...]]]:
    return [("HF Trainer", "hf", ()), ("ours, head everywhere", "ours", ("train.logits_at_labels=false",)),
            ("ours, head at labels", "ours", ("train.logits_at_labels=true", "train.logits_chunk_rows=0")),
            (f"ours, at labels, chunks of {chunk_rows}", "ours",
             ("train.logits_at_labels=true", f"train.logits_chunk_rows={chunk_rows}"))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocabs", default="32000,128000")
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--chunk-rows", type=int, default=128)
    args = parser.parse_args()
    loops = variants(args.chunk_rows)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for vocab in [int(v) for v in args.vocabs.split(",")]:
            model, data = make_model(tmp, vocab, args.shape), make_data(tmp, vocab)
            runs: dict[str, list[dict]] = {}
            for rep in range(args.repeats):  # the order reversed every other round (a shared machine drifts)
                for name, variant, sets in (loops if rep % 2 == 0 else loops[::-1]):
                    r = run_variant(variant, args.zero, data, model, args.steps, "random", tmp / "r.json", sets)
                    runs.setdefault(name, []).append(r)
                    print(f"vocab {vocab} {name:30s} {r['tokens_per_s']:8.0f} tok/s  peak RSS "
                          f"{r['peak_rss_mb']:7.0f} MB  CUDA {r['peak_cuda_mb']:7.0f} MB", flush=True)
            median = {name: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for name, rs in runs.items()}
            ref = median["HF Trainer"]
            for name, m in median.items():
                cuda = m["peak_cuda_mb"] / ref["peak_cuda_mb"] if ref["peak_cuda_mb"] else float("nan")
                rows.append((vocab, name, m["tokens_per_s"], m["tokens_per_s"] / ref["tokens_per_s"],
                             m["peak_rss_mb"], m["peak_rss_mb"] / ref["peak_rss_mb"], cuda))
    print(f"\n{args.shape} Qwen2 shape, ZeRO-{args.zero}, 2 ranks, rows of {LENGTH} tokens with a "
          f"{PROMPT}-token prompt; medians of {args.repeats}")
    print("| vocab | loop | real tokens/s | × HF Trainer | peak RSS MB | × HF Trainer | CUDA peak × HF |")
    print("|---|---|---|---|---|---|---|")
    for vocab, name, tps, rt, rss, rr, rc in rows:
        print(f"| {vocab} | {name} | {tps:.0f} | {rt:.2f} | {rss:.0f} | {rr:.2f} | {rc:.2f} |")


if __name__ == "__main__":
    main()
