"""Per-step losses and reward metrics of our preference objectives and of TRL's trainers on the
same model, data, order and DeepSpeed config (run under the DeepSpeed launcher; prints RESULT
lines: one per cell, {"cell", "ours", "trl"} with per-step dicts of loss and metrics).

Cells are "<objective>:<zero stage>", the objective optionally with DPO's loss ("dpo-ipo:0",
"dpo-hinge:0", "dpo-robust:0", robust with label smoothing 0.1), or "<objective>:tp" for ours under
tensor parallelism over every rank (ZeRO-1, one data rank): TRL then runs data-parallel with half
of each of our micro-batches per rank, so that each of its global micro-batches is one of ours. Our run goes first; the exact micro-batches our sampler
gave each rank are then laid out for TRL's sequential sampler (accelerate hands rank r the
batches r, r + world, ...), so that TRL trains on the same rows in the same order.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402

STEPS, MICRO, LR, WARMUP = 5, 4, 5e-3, 2  # a few steps, enough for the weights to move apart from the reference
BETA, GAMMA, LAMBDA, SMOOTHING = 0.2, 0.3, 0.3, 0.1
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "kl", "nll_loss", "log_odds_ratio", "log_odds_chosen")


def ours(work: Path, objective: str, zero: int, accum: int, data: Path, loss: str = "sigmoid", tp: int = 1):
    from contract.config.load import load_config
    from engine.trainer import Trainer
    cfg = load_config(overrides=[
        f"model.path={work / 'model'}", f"data.train={data}", "data.batching=random", f"objective={objective}",
        f"preference.beta={BETA}", f"preference.simpo_gamma={GAMMA}", f"preference.orpo_lambda={LAMBDA}",
        f"preference.dpo_loss={loss}", f"preference.label_smoothing={SMOOTHING if loss == 'robust' else 0}",
        f"max_steps={STEPS}", f"batch_size={MICRO}", f"train.grad_accum={accum}", f"lr={LR}",
        f"optim.warmup_steps={WARMUP}", "optim.scheduler=cosine", "optim.weight_decay=0", f"zero_stage={zero}",
        "precision=fp32", "eval.at_end=false", "checkpoint.save_at_end=false", "control.enabled=false",
        "logging.tensorboard=false", f"output_dir={work / 'runs'}", f"tp={tp}", f"nproc={os.environ['WORLD_SIZE']}"])
    trainer = Trainer(config=cfg)
    # (source, index) keys of the one source; with no row dropped, index i is the file's row i
    order = [[index for _, index in b] for b in trainer.train_loader(0).batch_sampler][: STEPS * accum]
    steps: list[dict] = []

    class Record:  # our callback: the step's loss and the objective's metrics
        def __getattr__(self, name):
            return lambda *args: None

        def on_train_batch_end(self, tr, loss):
            steps.append({"loss": loss, **tr.train_fn.metrics})

    trainer.callbacks.callbacks.append(Record())
    trainer.train()
    kept = trainer.data_reports["train"].rows_kept
    ds = dict(trainer.ds_setup.config)
    trainer.close()
    return steps, order, ds, kept


def trl_order(order: list[list[int]]) -> list[int]:
    """Our per-rank micro-batches as one sequence TRL's sharded sequential loader deals out alike."""
    world = dist.get_world_size()
    every: list = [None] * world
    dist.all_gather_object(every, order)
    return [i for k in range(len(order)) for r in range(world) for i in every[r][k]]


def trl(work: Path, objective: str, zero: int, accum: int, rows: list[dict], ds: dict,
        loss: str = "sigmoid", micro: int = MICRO) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from engine.model.loading import load_tokenizer

    logged: list[dict] = []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append({k: v for k, v in logs.items() if k == "loss" or k in METRICS})

    common = dict(output_dir=str(work / f"trl-{objective}-{loss}-{zero}"), per_device_train_batch_size=micro,
                  gradient_accumulation_steps=accum, max_steps=STEPS, learning_rate=LR, warmup_steps=WARMUP,
                  lr_scheduler_type="cosine", weight_decay=0.0, max_grad_norm=1.0, bf16=False, fp16=False,
                  deepspeed=ds, logging_steps=1, save_strategy="no", report_to=[], optim="adamw_torch",
                  train_sampling_strategy="sequential", dataloader_num_workers=0, seed=42,
                  use_cpu=not torch.cuda.is_available(), gradient_checkpointing=False, max_length=512,
                  remove_unused_columns=False)
    if objective == "dpo":
        from trl import DPOConfig, DPOTrainer
        args, trainer_class = DPOConfig(beta=BETA, loss_type=[loss], label_smoothing=SMOOTHING if loss == "robust"
                                        else 0.0, **common), DPOTrainer
    elif objective == "kto":
        from trl import KTOConfig, KTOTrainer
        args, trainer_class = KTOConfig(beta=BETA, **common), KTOTrainer
    elif objective == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        args, trainer_class = CPOConfig(loss_type="simpo", cpo_alpha=0.0, beta=BETA, simpo_gamma=GAMMA,
                                        **common), CPOTrainer
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        args, trainer_class = ORPOConfig(beta=LAMBDA, **common), ORPOTrainer
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"))  # after args: ZeRO-3 partitions it
    tok = load_tokenizer(work / "model")
    trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                            callbacks=[Log()])
    trainer.train()
    return logged


def forget_tensor_parallel() -> None:
    """DeepSpeed keeps the tensor-parallel mesh of our run in module globals, which its next
    engine (TRL's, data-parallel) would take for its own: a test-only reset before it."""
    from deepspeed.utils import groups
    groups.mpu = groups.mesh_device = None
    groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = groups._DATA_PARALLEL_GROUP = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--cells", required=True, help="objective:zero,... e.g. dpo:0,kto:2")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    work = Path(a.work)
    import json
    for cell in a.cells.split(","):
        name, zero = cell.split(":")
        objective, _, loss = name.partition("-")
        loss = loss or "sigmoid"
        data = work / ("unpaired.jsonl" if objective == "kto" else "pairs.jsonl")
        raw = [json.loads(line) for line in data.read_text().splitlines()]
        tp = int(os.environ["WORLD_SIZE"]) if zero == "tp" else 1
        stage = 1 if zero == "tp" else int(zero)
        steps, order, ds, kept = ours(work, objective, stage, a.accum, data, loss, tp)
        assert kept == len(raw), "every row is kept, so that index i is row i"
        if tp > 1:  # one data rank: TRL's ranks share each of our micro-batches, in order
            sequence, micro = [i for batch in order for i in batch], MICRO // tp
            ds = {k: v for k, v in ds.items() if k != "tensor_parallel"}
            forget_tensor_parallel()
            ds.update(train_micro_batch_size_per_gpu=micro, train_batch_size=MICRO * a.accum)
        else:
            sequence, micro = trl_order(order), MICRO
        theirs = trl(work, objective, stage, a.accum, [raw[i] for i in sequence], ds, loss, micro)
        if dist.get_rank() == 0:  # the figures are too long for a result line: a file, named by one
            out = work / f"parity-{name}-{zero}.json"
            out.write_text(json.dumps({"cell": cell, "ours": steps, "trl": theirs}))
            report(cell=cell, path=str(out))
        dist.barrier()


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
