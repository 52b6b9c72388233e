"""DPO speed against TRL's DPOTrainer: the same model, rows, order, batch and DeepSpeed config.

Run by hand (one rank, under the DeepSpeed launcher):

    .venv/bin/deepspeed --num_gpus 1 bench/bench_preference_trl.py [--method full|lora] [--steps 30]

Builds a small Llama (hidden 256, 4 layers) and 2,000 default-task pairs in a temporary folder,
trains `--steps` DPO steps with our Trainer, then with TRL's DPOTrainer on the very rows our
sampler drew, and prints each one's median step time over the steps after the first two and the
ratio of tokens per second (ours / TRL's; the tokens are the same). Target: at least 1.0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MICRO, LR = 16, 1e-4


def inputs(work: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from engine.default_task import build_tokenizer, make_examples, preference_row
    rows = make_examples(2000, 7)
    tok = build_tokenizer(r["input"] + r["output"] for r in rows)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                 pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id)).save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    (work / "pairs.jsonl").write_text("".join(json.dumps(preference_row(r)) + "\n" for r in rows))


def ours(work: Path, method: str, steps: int) -> tuple[list[float], list[int], dict]:
    from contract.config.load import load_config
    from engine.callbacks import Callback
    from engine.trainer import Trainer
    cfg = load_config(overrides=[
        f"model.path={work / 'model'}", f"data.train={work / 'pairs.jsonl'}", "objective=dpo", f"method={method}",
        f"max_steps={steps}", f"batch_size={MICRO}", f"lr={LR}", "optim.scheduler=constant", "precision=fp32",
        "data.batching=random", "eval.at_end=false", "checkpoint.save_at_end=false", "control.enabled=false",
        "logging.tensorboard=false", f"output_dir={work / 'runs'}"])
    times: list[float] = []

    class Clock(Callback):
        def on_train_batch_begin(self, trainer, batch):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, loss):
            times.append(time.perf_counter() - self.start)

    trainer = Trainer(config=cfg, callbacks=[Clock()])
    order = [index for b in trainer.train_loader(0).batch_sampler for _, index in b][: steps * MICRO]
    trainer.train()
    ds = dict(trainer.ds_setup.config)
    trainer.close()
    return times, order, ds


def trl(work: Path, method: str, steps: int, rows: list[dict], ds: dict) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

    args = DPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=MICRO, max_steps=steps,
                     learning_rate=LR, lr_scheduler_type="constant", bf16=False, fp16=False, deepspeed=ds,
                     logging_steps=1, save_strategy="no", report_to=[], optim="adamw_torch",
                     train_sampling_strategy="sequential", use_cpu=not torch.cuda.is_available(),
                     gradient_checkpointing=False, max_length=512, weight_decay=0.0)
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"))
    peft_config = None
    if method == "lora":
        from peft import LoraConfig
        from engine.methods import infer_lora_targets
        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=infer_lora_targets(model), task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(str(work / "model")),
                         callbacks=[Clock()], peft_config=peft_config)
    trainer.train()
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="full", choices=["full", "lora"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs(work)
        raw = [json.loads(line) for line in (work / "pairs.jsonl").read_text().splitlines()]
        mine, order, ds = ours(work, a.method, a.steps)
        theirs = trl(work, a.method, a.steps, [raw[i] for i in order], ds)
    ours_s, trl_s = statistics.median(mine[2:]), statistics.median(theirs[2:])
    print(f"\nDPO, method {a.method}, {a.steps} steps of {MICRO} pairs, 1 rank, fp32")
    print("| | median step (s) | tokens/s ratio (ours / TRL) |\n|---|---|---|")
    print(f"| ours | {ours_s:.3f} | {trl_s / ours_s:.2f} |\n| TRL DPOTrainer | {trl_s:.3f} | 1.00 |")


if __name__ == "__main__":
    main()
