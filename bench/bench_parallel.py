"""Training throughput and chat latency under each parallel layout, on 2 ranks.

Run by hand:  .venv/bin/python bench/bench_parallel.py [--steps 30] [--quick] [--json out.json]

Layouts: dp 2 with ZeRO-2 (the reference), dp 2 with ZeRO-3, tp 2 (AutoTP), pp 2 (DeepSpeed's
pipeline engine), and one rank for scale. Every layout trains the same model (a Llama of hidden
256, 4 layers, 4 heads, saved once with weights) on the same data (the default task's rows,
random batching) with the same micro-batch, accumulation and optimizer, through our Trainer
(`python -m deepspeed.launcher.runner --num_gpus N`, gloo on CPU, nccl on GPU: the same script on
either). Tokens/s counts the real tokens of every data-parallel replica over the steps after a
warm-up, wall clock on rank 0. Chat latency: `engine.generation.generate.generate` (the chat path, every
rank, collective) with 16 new tokens on the initial weights, repeated; first-token time is until
rank 0's first streamed text, per-token time the rest divided by the tokens that followed
(medians).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAYOUTS = {  # name -> (processes, run-config overrides)
    "dp2 ZeRO-2": (2, ["zero_stage=2"]),
    "dp2 ZeRO-3": (2, ["zero_stage=3"]),
    "tp2": (2, ["tp=2"]),
    "pp2": (2, ["pp=2"]),
    "1 rank": (1, []),
}
WARMUP, MICRO, ACCUM, NEW_TOKENS = 5, 16, 4, 16
PROMPT = "reverse: kcodw\n"


def make_assets(folder: Path, rows: int = 6000) -> tuple[Path, Path]:
    """The bench model (weights saved, so every layout starts from the same ones) and data."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from engine.data import default_task
    tok = default_task.build_tokenizer(default_task.alphabet())
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model_dir = folder / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in default_task.make_examples(rows, 0, "train")))
    return model_dir, data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, model: Path, data: Path, steps: int, repeats: int, work: Path) -> dict:
    nproc, _ = LAYOUTS[name]
    out = work / f"{name.replace(' ', '_')}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(Path(__file__).resolve()), "--worker", name,
           "--model", str(model), "--data", str(data), "--steps", str(steps), "--repeats", str(repeats),
           "--out", str(out)]
    log = work / f"{name.replace(' ', '_')}.log"
    with open(log, "w") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"{name} failed ({code}):\n{tail}")
    return json.loads(out.read_text())


# -- one rank of one layout ------------------------------------------------------------------------

def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from engine.callbacks import Callback
    from contract.config.load import load_config
    from engine.data import count_tokens
    from engine.generation.generate import generate
    from engine.trainer import Trainer

    nproc, overrides = LAYOUTS[a.worker]
    cfg = load_config(overrides=[
        f"model.path={a.model}", f"data.train={a.data}", "data.batching=random", "data.max_length=64",
        f"nproc={nproc}", *overrides, f"max_steps={a.steps}", f"batch_size={MICRO}",
        f"train.grad_accum={ACCUM}", "lr=1e-4", "optim.scheduler=constant", "eval.at_end=false",
        "checkpoint.save_at_end=false", "logging.tensorboard=false", "control.enabled=false",
        f"output_dir={Path(a.out).parent / 'runs'}", f"run_name={a.worker.replace(' ', '_')}"])

    class Clock(Callback):
        """Wall time and this replica's real tokens over the steps after WARMUP."""

        def __init__(self):
            self.steps, self.tokens, self.t0, self.t1, self.pending = 0, 0, None, None, 0

        def on_train_batch_begin(self, trainer, batch):
            self.pending = sum(count_tokens(b) for b in batch)

        def on_train_batch_end(self, trainer, loss):
            self.steps += 1
            if self.steps == WARMUP:
                self.t0 = time.perf_counter()
            elif self.steps > WARMUP:
                self.t1 = time.perf_counter()
                env = trainer.env  # one rank per replica counts (the others see the same batch)
                self.tokens += self.pending if env.tp_rank == 0 and env.stage == 0 else 0

    clock = Clock()
    trainer = Trainer(config=cfg, callbacks=[clock])
    # chat on the saved initial weights: latency does not depend on their values, and an
    # untrained model rarely ends its answer at once (a trained one may answer with eos alone)
    firsts, per_token = chat_latency(trainer, generate, a.repeats)
    trainer.train()
    total = torch.tensor([float(clock.tokens)], dtype=torch.float64)
    if trainer.env.world_size > 1:
        dist.all_reduce(total)
    if trainer.env.rank == 0:
        Path(a.out).write_text(json.dumps({
            "tokens_per_s": float(total) / (clock.t1 - clock.t0), "steps_timed": clock.steps - WARMUP,
            "first_token_ms": statistics.median(firsts) * 1e3 if firsts else None,
            "per_token_ms": statistics.median(per_token) * 1e3 if per_token else None,
            "device": str(trainer.env.device), "precision": trainer.precision}))
    trainer.close()


def chat_latency(trainer, generate, repeats: int) -> tuple[list[float], list[float]]:
    """First-text and per-token times of the chat path (collective: every rank generates)."""
    firsts, per_token = [], []
    for i in range(repeats + 1):  # the first generation warms up and is not counted
        marks: list[float] = []
        start = time.perf_counter()
        text = generate(trainer, [PROMPT], max_new_tokens=NEW_TOKENS,
                        on_text=lambda _: marks.append(time.perf_counter()))[0]
        end = time.perf_counter()
        if i and marks:
            firsts.append(marks[0] - start)
            n = len(trainer.tokenizer(text, add_special_tokens=False)["input_ids"])
            if n > 1:
                per_token.append((end - marks[0]) / (n - 1))
    return firsts, per_token


# -- the table -----------------------------------------------------------------------------------

def table(results: dict[str, dict]) -> str:
    ref = results.get("dp2 ZeRO-2", {}).get("tokens_per_s")
    lines = ["| layout (2 ranks unless noted) | tokens/s | vs dp2 ZeRO-2 | chat first token (ms) | per token (ms) |",
             "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        rel = f"{r['tokens_per_s'] / ref:.2f}x" if ref else "-"
        first = f"{r['first_token_ms']:.0f}" if r["first_token_ms"] is not None else "-"
        per = f"{r['per_token_ms']:.1f}" if r["per_token_ms"] is not None else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {rel} | {first} | {per} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per layout (the first 5 warm up)")
    p.add_argument("--quick", action="store_true", help="12 steps, 2 chat repeats: a smoke run")
    p.add_argument("--repeats", type=int, default=5, help="timed chat generations per layout")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of: " + ", ".join(LAYOUTS))
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--data", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.steps, a.repeats = 12, 2
    if a.worker:
        worker(a)
        return
    names = [n.strip() for n in a.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; allowed: {', '.join(LAYOUTS)}")
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        sys.exit(f"2-rank layouts need 2 GPUs; this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        work = Path(tmp)
        model, data = make_assets(work)
        results = {}
        for name in names:
            started = time.perf_counter()
            results[name] = run_layout(name, model, data, a.steps, a.repeats, work)
            print(f"{name}: {results[name]}  ({time.perf_counter() - started:.0f} s)", flush=True)
    print()
    print(table(results))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
