"""Runs of our Trainer (and, with --hf, the Hugging Face Trainer) on the same tiny model and uneven
data, each saved to WORK/NAME.pt: per-step losses, gradient norms and the final weights (rank 0).

    --runs NAME:OVERRIDE,OVERRIDE;NAME:...   our runs, each a config override list
    --hf NAME:MICRO:ACCUM[:mean]             the HF Trainer at its defaults (token-weighted), or,
                                             with `mean`, forced to per-micro-batch means

Every run trains STEPS steps of 4 samples on the ranks' order of the same seeded permutation, so
every split of a step (micro-batch x accumulation x ranks) trains the same 4 samples.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STEPS = 6
COMMON = ["data.format=input_output", "data.batching=random", f"max_steps={STEPS}", "lr=3e-3",
          "optim.warmup_steps=2", "optim.scheduler=linear", "optim.weight_decay=0.01", "precision=fp32",
          "optim.grad_clip=1.0", "eval.at_end=false", "checkpoint.save_at_end=false",
          "control.enabled=false", "logging.tensorboard=false", "logging.progress_bar=false", "seed=7"]


def ours(work: Path, name: str, overrides: list[str]) -> None:
    from contract.config.load import load_config
    from engine.callbacks import Callback
    from engine.parallel.layouts import full_state_dict
    from engine.trainer import Trainer

    cfg = load_config(overrides=[f"model.path={work / 'model'}", f"data.train={work / 'train.jsonl'}",
                                 *COMMON, *overrides, f"output_dir={work / 'runs'}", f"run_name={name}"])
    losses, norms = [], []

    class Record(Callback):
        def on_train_batch_end(self, trainer, loss):
            losses.append(loss)
            norm = trainer.engine.get_global_grad_norm() if trainer.engine.optimizer is not None else None
            if norm is None and hasattr(trainer.optimizer, "last_grad_norm"):
                norm = trainer.optimizer.last_grad_norm  # the fused LOMO optimizer's
            norms.append(float(norm) if norm is not None else float("nan"))

    trainer = Trainer(config=cfg, callbacks=[Record()])
    trainer.train()
    if cfg.parallel.zero_stage == 3:  # the layout's gather writes files; here the weights are enough
        import deepspeed
        module = trainer.engine.module
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    else:
        state = full_state_dict(trainer.ctx)
    if trainer.env.rank == 0:
        torch.save({"losses": losses, "norms": norms, "weights": state}, work / f"{name}.pt")
    trainer.close()


def hf(work: Path, name: str, micro: int, accum: int, mean: bool) -> None:
    """The HF Trainer on the micro-batches our 1-rank sampler gives (the same order)."""
    from transformers import AutoModelForCausalLM, Trainer as HFTrainer, TrainerCallback, TrainingArguments
    from contract.config.load import load_config
    from engine.data import PaddingCollator
    from engine.model.loading import load_tokenizer
    from engine.trainer import Trainer

    cfg = load_config(overrides=[f"model.path={work / 'model'}", f"data.train={work / 'train.jsonl'}",
                                 *COMMON, f"batch_size={micro}", f"train.grad_accum={accum}",
                                 f"output_dir={work / 'runs'}", f"run_name={name}-order"])
    probe = Trainer(config=cfg)
    order = [i for b in probe.train_loader(0).batch_sampler for i in b][: STEPS * micro * accum]
    rows, ds = [probe.train_dataset[i] for i in order], dict(probe.ds_setup.config)
    probe.close()
    del probe
    losses, norms = [], []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])
                norms.append(float(logs.get("grad_norm", float("nan"))))

    args = TrainingArguments(
        output_dir=str(work / "hf"), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        max_steps=STEPS, learning_rate=3e-3, warmup_steps=2, lr_scheduler_type="linear", weight_decay=0.01,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, deepspeed=ds,
        logging_steps=1, save_strategy="no", report_to=[], optim="adamw_torch",
        train_sampling_strategy="sequential", dataloader_num_workers=0, seed=cfg.train.seed,
        use_cpu=not torch.cuda.is_available())
    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"))
    trainer = HFTrainer(model=model, args=args, train_dataset=rows,
                        data_collator=PaddingCollator(load_tokenizer(work / "model")), callbacks=[Log()])
    if mean:
        trainer.model_accepts_loss_kwargs = False  # HF's per-micro-batch mean (before 4.46)
    trainer.train()
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "norms": norms, "weights": None}, work / f"{name}.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--runs", default="")
    p.add_argument("--hf", default="")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    work = Path(a.work)
    for spec in filter(None, a.runs.split(";")):
        name, overrides = spec.split(":", 1)
        ours(work, name, overrides.split(","))
    for spec in filter(None, a.hf.split(";")):
        name, micro, accum, *mode = spec.split(":")
        hf(work, name, int(micro), int(accum), mode == ["mean"])
    # Every result is written: end without the interpreter's teardown, as engine/worker.py does.
    # Once, after all its work, a rank aborted there ("terminate called without an active
    # exception", -6: a communication thread destroyed at exit) and failed the launch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
