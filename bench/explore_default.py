"""Explore the embedded default task: how fast does a tiny Llama learn it on this CPU?

A plain PyTorch loop (AdamW, linear warmup + cosine decay, loss on the answer only) over the
default task's rows, timing the training steps and measuring held-out exact match at intervals
(evaluation time is kept out of the training clock). The figures quoted in
engine/data/default_task.py come from this script; rerun it to check them:

    .venv/bin/python bench/explore_default.py                       # the recommended setting
    .venv/bin/python bench/explore_default.py --precision fp32      # compare precisions
    .venv/bin/python bench/explore_default.py --matmul              # bf16 vs fp32 matmul speed
    .venv/bin/python bench/explore_default.py --hidden 96 --lr 5e-3 --steps 800 --ops reverse

Prints one line per evaluation and a JSON summary at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from engine.data import default_task as dt  # noqa: E402
from contract.config.schema import OptimConfig  # noqa: E402
from contract import presets


def parse_args() -> argparse.Namespace:
    rec = presets.RECOMMENDED
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", nargs="+", default=sorted(dt.OPERATIONS), help="instructions to train")
    p.add_argument("--hidden", type=int, default=presets.MODEL_SIZE["hidden"])
    p.add_argument("--layers", type=int, default=presets.MODEL_SIZE["layers"])
    p.add_argument("--heads", type=int, default=presets.MODEL_SIZE["heads"])
    p.add_argument("--intermediate", type=int, default=presets.MODEL_SIZE["intermediate"])
    p.add_argument("--lr", type=float, default=rec["lr"])
    p.add_argument("--batch", type=int, default=rec["micro_batch_size"])
    p.add_argument("--steps", type=int, default=rec["max_steps"])
    p.add_argument("--betas", type=float, nargs=2, default=OptimConfig().betas,
                   help="AdamW betas (default: the run config's)")
    p.add_argument("--warmup", type=int, default=rec["warmup_steps"])
    p.add_argument("--eval-every", type=int, default=rec["eval_every_n_steps"])
    p.add_argument("--eval-rows", type=int, default=dt.N_EVAL)
    p.add_argument("--precision", choices=["bf16", "autocast", "fp32"], default="bf16",
                   help="bf16: bf16 weights with fp32 master copy in the optimizer (what "
                   "DeepSpeed's bf16 mode does); autocast: fp32 weights, bf16 matmuls")
    p.add_argument("--batching", choices=["random", "group_by_length"], default="random",
                   help="group_by_length: like engine/data/sampler.py, megabatches of 50 "
                   "batches sorted by length, so each batch holds samples of one length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--stop-at", type=float, default=0.0, help="stop once exact match >= this")
    p.add_argument("--matmul", action="store_true", help="only measure bf16 vs fp32 matmul")
    return p.parse_args()


def matmul_speed(threads: int) -> dict:
    """GFLOP/s of square matmuls in fp32 and bf16 at the sizes a tiny model uses."""
    torch.set_num_threads(threads)
    result = {}
    for n in (128, 256, 512):
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(1024, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            for _ in range(5):
                a @ b
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < 0.5:
                a @ b
                count += 1
            flops = 2 * 1024 * n * n * count / (time.perf_counter() - start)
            result[f"{n}/{str(dtype).split('.')[-1]}"] = round(flops / 1e9, 1)
    return result


def encode(tokenizer, rows: list[dict]) -> list[tuple[list[int], int]]:
    """(token ids of prompt + answer + eos, prompt length) per row."""
    prompts = tokenizer([r["input"] for r in rows])["input_ids"]
    answers = tokenizer([r["output"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p + a + [tokenizer.eos_token_id], len(p)) for p, a in zip(prompts, answers)]


def collate(samples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch; labels only on the answer (and its eos)."""
    width = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), width), pad_id)
    labels = torch.full((len(samples), width), -100)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, (ids, prompt_len) in enumerate(samples):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, prompt_len:len(ids)] = torch.tensor(ids[prompt_len:])
        mask[i, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def batch_order(data: list[tuple[list[int], int]], args: argparse.Namespace) -> list[int]:
    """Sample order: a permutation, or length-sorted megabatches whose batches are shuffled."""
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(data), generator=gen).tolist()
    if args.batching == "random":
        return order
    mega = 50 * args.batch
    batches = []
    for start in range(0, len(order), mega):
        part = sorted(order[start:start + mega], key=lambda i: -len(data[i][0]))
        batches += [part[i:i + args.batch] for i in range(0, len(part), args.batch)]
    return [i for b in torch.randperm(len(batches), generator=gen).tolist() for i in batches[b]]


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def per_operation(model, tokenizer, rows: list[dict]) -> dict[str, float]:
    """Exact match of each instruction on its own (which one holds the average back?)."""
    by_op: dict[str, list[dict]] = {}
    for row in rows:
        by_op.setdefault(row["input"].split(":")[0], []).append(row)
    return {op: round(dt.exact_match(model, tokenizer, part), 3) for op, part in sorted(by_op.items())}


def train(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rows = dt.make_examples(args.steps * args.batch, dt.ASSETS_SEED, "train", args.ops)
    held_out = dt.make_examples(args.eval_rows, dt.ASSETS_SEED, "eval", args.ops)
    tokenizer = dt.build_tokenizer(r["input"] + r["output"] for r in rows)
    config = dt.default_model_config(len(tokenizer), hidden=args.hidden, layers=args.layers,
                                     heads=args.heads, intermediate=args.intermediate)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    master = [p for p in model.parameters()]
    if args.precision == "bf16":  # fp32 master weights in the optimizer, bf16 in the model
        master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        model.to(torch.bfloat16)
    opt = torch.optim.AdamW(master, lr=args.lr, weight_decay=0.0, betas=tuple(args.betas))
    data = encode(tokenizer, rows)
    order = batch_order(data, args)
    curve, train_time, summary = [], 0.0, {}
    for step in range(args.steps):
        start = time.perf_counter()
        batch = collate([data[i] for i in order[step * args.batch:(step + 1) * args.batch]],
                        tokenizer.pad_token_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "autocast"):
            loss = model(**batch).loss
        loss.backward()
        if args.precision == "bf16":
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, args.steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.precision == "bf16":
            with torch.no_grad():
                for m, p in zip(master, model.parameters()):
                    p.copy_(m)
        train_time += time.perf_counter() - start
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            eval_start = time.perf_counter()
            em = dt.exact_match(model, tokenizer, held_out)
            point = {"step": step + 1, "train_s": round(train_time, 1), "loss": round(loss.item(), 4),
                     "exact_match": round(em, 3), "eval_s": round(time.perf_counter() - eval_start, 1),
                     "by_op": per_operation(model, tokenizer, held_out) if len(args.ops) > 1 else {}}
            curve.append(point)
            print(json.dumps(point), flush=True)
            if args.stop_at and em >= args.stop_at:
                break
    summary = {"args": vars(args), "parameters": params, "curve": curve,
               "ms_per_step": round(1000 * train_time / curve[-1]["step"], 1),
               "first_step_reaching_0.9": next((c["step"] for c in curve if c["exact_match"] >= 0.9), None),
               "train_s_reaching_0.9": next((c["train_s"] for c in curve if c["exact_match"] >= 0.9), None)}
    return summary


def main() -> None:
    args = parse_args()
    if args.matmul:
        print(json.dumps({"threads": args.threads, "gflops": matmul_speed(args.threads)}))
        return
    print(json.dumps(train(args)))


if __name__ == "__main__":
    main()
