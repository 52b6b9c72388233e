"""Peak memory of DPO with LoRA against SFT with LoRA: the reference (the adapter switched off)
should cost nothing but its forward's transient tensors (target: at most 1.1x).

Run by hand:  .venv/bin/python bench/bench_preference_memory.py [--hidden 1024 --layers 12 --vocab 32000]

Each case trains in a fresh process (bench_methods.child's method): the same Llama-shaped model
(from a config, random weights), LoRA, ZeRO 0, the same rows and steps. DPO takes `--pairs` pairs
a step; SFT takes the same sequences as rows (each pair's chosen and rejected answers, 2 x pairs
rows), so both put the same tokens through the forward and backward with gradient, and DPO adds
the reference's forward without gradient. Memory is CUDA's peak allocated on a GPU and, here,
the process's peak RSS above its size just before the Trainer is built (the same measure as
bench_methods.py's LOMO figures); the table prints both ratios to SFT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_methods import PeakRSS, child_result  # noqa: E402  (beside this file)


def make_assets(root: Path, a) -> tuple[Path, Path, Path]:
    """A model folder (config and the default tokenizer, no weights), a pairs file and the same
    answers as SFT rows."""
    from engine.data import default_task as dt
    tok = dt.build_tokenizer([])
    model_dir = root / "model"
    tok.save_pretrained(model_dir)
    config = dt.default_model_config(len(tok), hidden=a.hidden, layers=a.layers, heads=a.heads,
                                     intermediate=a.hidden * 8 // 3)
    config.vocab_size = max(a.vocab, len(tok))  # a real model's output head: its logits are much of the memory
    config.max_position_embeddings = max(config.max_position_embeddings, a.seq)
    config.save_pretrained(model_dir)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "

    def text(n: int) -> str:
        return "".join(rng.choice(letters) for _ in range(n))

    third = a.seq // 3  # prompt, then an answer of about the same length each: a pair fits max_length
    pairs = [{"prompt": text(third), "chosen": text(third - 2), "rejected": text(third - 2)} for _ in range(a.rows)]
    rows = [{"input": p["prompt"], "output": p[key]} for p in pairs for key in ("chosen", "rejected")]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, root / "pairs.jsonl", root / "rows.jsonl"


def child(a) -> None:
    from contract.config.load import load_config
    dpo = a.case == "dpo"
    cfg = load_config(overrides=[
        f"model.path={a.model}", f"data.train={a.data}", "method=lora", "zero_stage=0",
        f"objective={'dpo' if dpo else 'sft'}", f"max_steps={a.steps}",
        f"batch_size={a.pairs if dpo else 2 * a.pairs}", f"data.max_length={a.seq}", "data.batching=random",
        f"precision={a.precision}", "optim.warmup_steps=0", "eval.at_end=false", "eval.every_n_steps=0",
        "checkpoint.save_at_end=false", "control.enabled=false", "logging.tensorboard=false",
        f"output_dir={a.out}", f"run_name={a.case}-{os.getpid()}"])
    peak, train = measured_train(cfg)
    print("RESULT " + json.dumps({**peak, "tokens": sum(e["tokens"] for e in train) / len(train),
                                  "loss": [round(e["loss"], 4) for e in train]}), flush=True)


def measured_train(cfg) -> tuple[dict, list[dict]]:
    """Train `cfg` in this process: ({peak_mib, memory: what it measures}, its train events). The
    peak is CUDA's peak allocated on a GPU, else the peak RSS above the size before the Trainer."""
    import psutil
    import torch
    from engine.trainer import Trainer
    cuda = torch.cuda.is_available()
    base = psutil.Process().memory_info().rss
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as rss:
        trainer = Trainer(config=cfg)
        trainer.train()
    events = [json.loads(line) for line in trainer.folder.events.read_text().splitlines()]
    trainer.close()
    return ({"peak_mib": (torch.cuda.max_memory_allocated() if cuda else rss.peak - base) / 2**20,
             "memory": "CUDA peak allocated" if cuda else "peak RSS above the size before the Trainer"},
            [e for e in events if e["type"] == "train"])


def run(a, case: str, model: Path, data: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", case, "--model", str(model), "--data", str(data), "--out", str(out),
           "--pairs", str(a.pairs), "--seq", str(a.seq), "--steps", str(a.steps), "--precision", a.precision]
    return child_result(cmd, case)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=4, help="pairs a step (SFT: twice as many rows)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--child", choices=["sft", "dpo"])
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--model"), ap.add_argument("--data"), ap.add_argument("--out")
    a = ap.parse_args()
    if a.child:
        a.case = a.child
        return child(a)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, pairs, rows = make_assets(root, a)
        sft = run(a, "sft", model, rows, root / "runs")
        dpo = run(a, "dpo", model, pairs, root / "runs")
    print(f"\nLlama hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, seq {a.seq}, LoRA, {a.precision}, "
          f"{a.pairs} pairs a step (SFT: {2 * a.pairs} rows); memory: {sft['memory']}\n")
    print("| objective | peak memory (MiB) | x SFT | tokens a step |\n|---|---|---|---|")
    for name, r in (("sft", sft), ("dpo", dpo)):
        print(f"| {name} | {r['peak_mib']:.0f} | {r['peak_mib'] / sft['peak_mib']:.2f} | {r['tokens']:.0f} |")


if __name__ == "__main__":
    main()
