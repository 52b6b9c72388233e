"""One rank of one bench_trainer.py variant (started by the DeepSpeed launcher, 2 ranks).

Variants share the model folder, the data file and the DeepSpeed config (built by our layer
from one run config), and all time the same window: steps after WARMUP to the last, on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contract.config.load import load_config  # noqa: E402
from contract import deepspeed_config

WARMUP = 5
MICRO = 8


def run_config(a):
    return load_config(overrides=[f"model.path={a.model}", f"data.train={a.data}", "data.format=tokenized",
                                  f"data.batching={a.batching}", "data.max_length=256", f"max_steps={a.steps}",
                                  f"zero_stage={a.zero}", "nproc=2", f"batch_size={MICRO}", "lr=1e-4",
                                  "optim.scheduler=constant", "eval.at_end=false", "checkpoint.save_at_end=false",
                                  "logging.tensorboard=false", "control.enabled=false",
                                  f"output_dir={Path(a.out).parent / 'runs'}", f"run_name=r{a.zero}{a.variant}",
                                  *a.set])


class Clock:
    """Wall time of the steps after WARMUP and the real tokens they trained (all ranks)."""

    def __init__(self):
        self.t0 = self.t1 = None
        self.tokens = 0
        self.step = 0

    def step_done(self, tokens: int) -> None:
        self.step += 1
        if self.step == WARMUP:
            self.t0 = time.perf_counter()
        elif self.step > WARMUP:
            self.tokens += tokens
            self.t1 = time.perf_counter()

    def result(self) -> dict:
        total = torch.tensor([float(self.tokens)])
        dist.all_reduce(total)
        # peak memory of the busiest rank: its process's peak RSS (the model's weights, the
        # optimizer state, activations and logits; everything the process touched), and on a
        # GPU the CUDA allocator's peak
        peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                             torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {"tokens_per_s": float(total) / (self.t1 - self.t0), "steps": self.step,
                "peak_rss_mb": float(peak[0]), "peak_cuda_mb": float(peak[1])}


def ds_config_for(cfg, hidden: int) -> dict:
    from engine.parallel import ds_config
    return deepspeed_config.build_ds_config(cfg, world_size=2, dp_size=2, total_steps=cfg.train.max_steps,
                                     warmup_steps=0, hidden_size=hidden,
                                     precision=ds_config.resolve_precision("auto")).config


BACKEND = "nccl" if torch.cuda.is_available() else "gloo"


def bare(a, cfg, clock):
    import deepspeed
    from transformers import AutoModelForCausalLM
    from engine.parallel import ds_config
    from engine.data import build_dataset, build_dataloader
    from engine.model.loading import load_tokenizer
    deepspeed.init_distributed(dist_backend=BACKEND)
    ds = ds_config_for(cfg, 256)
    tok = load_tokenizer(a.model)
    with ds_config.zero3_init(ds):
        model = AutoModelForCausalLM.from_pretrained(a.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    dataset, _ = build_dataset(str(a.data), tok, format="tokenized", max_length=256)
    loader = build_dataloader(dataset, micro_batch_size=MICRO, dp_rank=dist.get_rank(), dp_size=2, seed=0,
                              strategy="random", tokenizer=tok, max_length=256)
    for step, batch in enumerate(loader):
        if step == a.steps:
            break
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        clock.step_done(int(batch["attention_mask"].sum()))  # this rank's; result() sums the ranks
    return clock


def hf(a, cfg, clock):
    import deepspeed
    # before the model is built: under ZeRO-3, from_pretrained partitions it over the whole group
    deepspeed.init_distributed(dist_backend=BACKEND)
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from engine.data import PaddingCollator, build_dataset
    from engine.model.loading import load_tokenizer
    ds = ds_config_for(cfg, 256)
    args = TrainingArguments(output_dir=str(Path(a.out).parent / "hf"), per_device_train_batch_size=MICRO,
                             max_steps=a.steps, learning_rate=1e-4, lr_scheduler_type="constant",
                             bf16=ds.get("bf16", {}).get("enabled", False), deepspeed=ds, logging_steps=10**6,
                             save_strategy="no", report_to=[], optim="adamw_torch", dataloader_num_workers=0,
                             train_sampling_strategy=a.batching, use_cpu=not torch.cuda.is_available())
    tok = load_tokenizer(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model)
    dataset, _ = build_dataset(str(a.data), tok, format="tokenized", max_length=256)
    collate = PaddingCollator(tok)
    seen = []

    def counting_collate(items):
        batch = collate(items)
        seen.append(int(batch["attention_mask"].sum()))
        return batch

    class Tick(TrainerCallback):
        def on_step_end(self, *_args, **_kw):
            clock.step_done(seen[clock.step] if clock.step < len(seen) else 0)

    rows = [{"input_ids": x["input_ids"], "labels": x["labels"]} for x in dataset]
    trainer = Trainer(model=model, args=args, train_dataset=_ListDataset(rows), data_collator=counting_collate,
                      callbacks=[Tick()])
    trainer.train()
    return clock


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows
        self.lengths = [len(r["input_ids"]) for r in rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def ours(a, cfg, clock):
    from engine.callbacks import Callback
    from engine.data import count_tokens
    from engine.trainer import Trainer

    class Tick(Callback):
        tokens = 0

        def on_train_batch_begin(self, trainer, micro_batches):
            self.tokens = sum(count_tokens(b) for b in micro_batches)

        def on_train_batch_end(self, trainer, loss):
            clock.step_done(self.tokens)

    trainer = Trainer(config=cfg, callbacks=[Tick()])
    trainer.train()
    return clock


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("variant", "data", "model", "out", "batching"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--zero", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="a config override for our Trainer (repeatable)")
    a = p.parse_args()
    cfg = run_config(a)
    clock = {"bare": bare, "hf": hf, "ours": ours}[a.variant](a, cfg, Clock())
    result = clock.result()
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
