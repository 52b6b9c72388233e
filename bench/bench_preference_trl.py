"""DPO speed against TRL's DPOTrainer: the same model, rows, order, batch and DeepSpeed config.

Run by hand (one rank, under the DeepSpeed launcher):

    OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 1 bench/bench_preference_trl.py \
        [--method full|lora] [--steps 30] [--vocab 32000] [--first ours|trl] [--profile 5]

Builds a small Llama (hidden 256, 4 layers; `--vocab`: an output head that wide) and 2,000
default-task pairs in a temporary folder, trains `--steps` DPO steps with our Trainer and with
TRL's DPOTrainer on the very rows our sampler drew (`--first`: which trains first), and prints
each one's median step time over the steps after the first two, the ratio of tokens per second
(ours / TRL's; the tokens are the same; target: at least 1.0), and the median CPU time a step
takes (every thread of the process): on a loaded machine the wall-clock ratio is mostly noise,
while the CPU time with one thread is the work done. `--profile N` prints torch.profiler's op
tables of step N of each (op counts, matmul FLOPs, input shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MICRO, LR = 16, 1e-4


class StepClock:
    """Each step's wall time and the CPU time of this process (every thread; with one thread,
    OMP_NUM_THREADS=1, the work done, whatever the machine's load); torch.profiler's op table
    of the step numbered `profile` (0: the first; -1: none)."""

    def __init__(self, profile: int = -1):
        self.profile, self.wall, self.cpu = profile, [], []
        self.waits: list[int] = []  # voluntary context switches: the times the process blocked
        self.prof: torch.profiler.profile | None = None
        self.result: torch.profiler.profile | None = None

    def begin(self) -> None:
        if len(self.wall) == self.profile:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                               with_flops=True, record_shapes=True)
            self.prof.__enter__()
        self.start = (time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw)

    def end(self) -> None:
        self.wall.append(time.perf_counter() - self.start[0])
        self.cpu.append(time.process_time() - self.start[1])
        self.waits.append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - self.start[2])
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.result, self.prof = self.prof, None

    def medians(self) -> tuple[float, float, float]:
        """Median wall and CPU seconds a step and blocking waits, over the steps after the first two."""
        return statistics.median(self.wall[2:]), statistics.median(self.cpu[2:]), statistics.median(self.waits[2:])

    def report(self, name: str, rows: int = 25) -> None:
        """The profiled step's op table: by op, then by op and input shapes."""
        if self.result is None:
            return
        events = self.result.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        flops = sum(e.flops for e in events)
        counted = ("aten::mm", "aten::addmm", "aten::embedding", "aten::scaled_dot_product_attention",
                   "aten::_log_softmax", "aten::copy_", "aten::item", "aten::dropout", "c10d::allreduce_")
        calls = {k: sum(e.count for e in events if e.key == k) for k in counted}
        print(f"\n== one step, {name}: ops' self CPU {total / 1e3:.1f} ms, matmuls {flops / 1e9:.2f} GFLOP, "
              f"calls {calls}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))
        shaped = self.result.key_averages(group_by_input_shape=True)
        print(shaped.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=30,
                           max_shapes_column_width=70))


def inputs(work: Path, vocab: int) -> int:
    """The model, tokenizer and pairs in `work`; returns the model's vocabulary size."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from engine.data.default_task import build_tokenizer, make_examples, preference_row
    rows = make_examples(2000, 7)
    tok = build_tokenizer(r["input"] + r["output"] for r in rows)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=max(vocab, len(tok)), hidden_size=256, intermediate_size=768,
                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                 max_position_embeddings=64,
                                 pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    (work / "pairs.jsonl").write_text("".join(json.dumps(preference_row(r)) + "\n" for r in rows))
    return max(vocab, len(tok))


def ours(work: Path, method: str, steps: int, clock: StepClock):
    """Our Trainer, built (not trained yet): its sampler's row order and its DeepSpeed config."""
    from contract.config.load import load_config
    from engine.callbacks import Callback
    from engine.trainer import Trainer
    cfg = load_config(overrides=[
        f"model.path={work / 'model'}", f"data.train={work / 'pairs.jsonl'}", "objective=dpo", f"method={method}",
        f"max_steps={steps}", f"batch_size={MICRO}", f"lr={LR}", "optim.scheduler=constant", "precision=fp32",
        "data.batching=random", "eval.at_end=false", "checkpoint.save_at_end=false", "control.enabled=false",
        "logging.tensorboard=false", f"output_dir={work / 'runs'}"])

    class Clock(Callback):
        def on_train_batch_begin(self, trainer, batch):
            clock.begin()

        def on_train_batch_end(self, trainer, loss):
            clock.end()

    trainer = Trainer(config=cfg, callbacks=[Clock()])
    order = [index for b in trainer.train_loader(0).batch_sampler for _, index in b][: steps * MICRO]
    return trainer, order, dict(trainer.ds_setup.config)


def trl(work: Path, method: str, steps: int, rows: list[dict], ds: dict, clock: StepClock) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.end()

    args = DPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=MICRO, max_steps=steps,
                     learning_rate=LR, lr_scheduler_type="constant", bf16=False, fp16=False, deepspeed=ds,
                     logging_steps=1, save_strategy="no", report_to=[], optim="adamw_torch",
                     train_sampling_strategy="sequential", use_cpu=not torch.cuda.is_available(),
                     gradient_checkpointing=False, max_length=512, weight_decay=0.0)
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"))
    peft_config = None
    if method == "lora":
        from peft import LoraConfig
        from engine.model.methods import infer_lora_targets
        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=infer_lora_targets(model), task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(str(work / "model")),
                         callbacks=[Clock()], peft_config=peft_config)
    trainer.train()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="full", choices=["full", "lora"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile", type=int, default=-1, metavar="STEP",
                   help="print torch.profiler's op table of step STEP (0: the first) of each trainer")
    p.add_argument("--vocab", type=int, default=0,
                   help="the model's vocabulary (output head) at least this wide, the tokenizer's tokens first "
                        "(as a real model's, where the head is much of the work)")
    p.add_argument("--first", default="ours", choices=["ours", "trl"], help="which trainer trains first")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    mine, theirs = StepClock(a.profile), StepClock(a.profile)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vocab = inputs(work, a.vocab)
        raw = [json.loads(line) for line in (work / "pairs.jsonl").read_text().splitlines()]
        trainer, order, ds = ours(work, a.method, a.steps, mine)
        if a.first == "trl":  # the second one runs in a warmer process: the flag shows what that is worth
            trl(work, a.method, a.steps, [raw[i] for i in order], ds, theirs)
        trainer.train()
        trainer.close()
        if a.first == "ours":
            trl(work, a.method, a.steps, [raw[i] for i in order], ds, theirs)
    mine.report("ours")
    theirs.report("TRL DPOTrainer")
    (ours_s, ours_cpu, ours_waits), (trl_s, trl_cpu, trl_waits) = mine.medians(), theirs.medians()
    print(f"\nDPO, method {a.method}, {a.steps} steps of {MICRO} pairs, vocabulary {vocab}, 1 rank, fp32, "
          f"{a.first} first, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print("| | median step (s) | tokens/s ratio (ours / TRL) | median CPU s / step | CPU ratio (TRL / ours) "
          "| blocking waits / step |")
    print("|---|---|---|---|---|---|")
    print(f"| ours | {ours_s:.3f} | {trl_s / ours_s:.2f} | {ours_cpu:.3f} | {trl_cpu / ours_cpu:.2f} "
          f"| {ours_waits:.0f} |")
    print(f"| TRL DPOTrainer | {trl_s:.3f} | 1.00 | {trl_cpu:.3f} | 1.00 | {trl_waits:.0f} |")


if __name__ == "__main__":
    main()
