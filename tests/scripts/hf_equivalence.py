"""Per-step losses of our Trainer and of the Hugging Face Trainer on the same model, data, order
and DeepSpeed config (run under the DeepSpeed launcher; prints RESULT lines)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402

STEPS, MICRO = 24, 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    work = Path(a.work)

    from transformers import AutoModelForCausalLM, Trainer as HFTrainer, TrainerCallback, TrainingArguments
    from contract.config.load import load_config
    from engine.data import PaddingCollator
    from engine.trainer import Trainer

    cfg = load_config(overrides=[f"model.path={work / 'model'}", f"data.train={work / 'train.jsonl'}",
                                 "data.format=input_output", "data.batching=random", f"max_steps={STEPS}",
                                 f"batch_size={MICRO}", "lr=2e-3", "optim.warmup_steps=4",
                                 "optim.scheduler=cosine", f"zero_stage={a.zero}", f"precision={a.precision}",
                                 "optim.weight_decay=0.01", "eval.at_end=false",
                                 "checkpoint.save_at_end=false", "control.enabled=false",
                                 "logging.tensorboard=false", f"output_dir={work / 'runs'}"])
    ours = Trainer(config=cfg)
    # the exact micro-batches our sampler gives this rank, in order: the HF Trainer gets them too
    order = [i for batch in ours.train_loader(0).batch_sampler for i in batch][: STEPS * MICRO]
    losses: list[float] = []

    class Record:  # our callback
        def __getattr__(self, name):
            return lambda *args: None

        def on_train_batch_end(self, trainer, loss):
            losses.append(loss)

    ours.callbacks.callbacks.append(Record())
    ours.train()
    rows = [ours.train_dataset[i] for i in order]
    ds = dict(ours.ds_setup.config)
    ours.close()
    del ours

    hf_losses: list[float] = []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                hf_losses.append(logs["loss"])

    args = TrainingArguments(
        output_dir=str(work / "hf"), per_device_train_batch_size=MICRO, max_steps=STEPS,
        learning_rate=2e-3, warmup_steps=4, lr_scheduler_type="cosine", weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        bf16=a.precision == "bf16", deepspeed=ds, logging_steps=1, save_strategy="no", report_to=[],
        optim="adamw_torch", train_sampling_strategy="sequential", dataloader_num_workers=0,
        seed=cfg.train.seed, use_cpu=not torch.cuda.is_available(), average_tokens_across_devices=False)
    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"))
    hf = HFTrainer(model=model, args=args, train_dataset=rows, data_collator=PaddingCollator(ours_tok(work)),
                   callbacks=[Log()])
    hf.train()
    if dist.get_rank() == 0:
        report(ours=losses, hf=hf_losses)


def ours_tok(work: Path):
    from engine.model.loading import load_tokenizer
    return load_tokenizer(work / "model")


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
