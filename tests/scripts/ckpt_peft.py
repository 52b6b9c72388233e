"""LoRA under ZeRO-3 on the launcher's ranks: train a few steps, then export the base model, the
adapter (PEFT layout, a non-default adapter name) and the merged model, with the engine's logits
for the test to compare; load the adapter back into the engine; ask for an unknown adapter."""

import argparse
from pathlib import Path

import torch

from ckpt_common import make_task, overrides, report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from engine import checkpoint as ck
    from engine.checkpoint import adapters, models
    from contract.config.load import load_config
    from engine.trainer import Trainer

    task = make_task(Path(a.out) / "task", dropout=0.0)
    cfg = load_config(overrides=overrides(task, a.out, "lora", 3, [
        "method=lora", "method.adapter_name=mine", "method.lora_r=4", "epochs=1", "lr=2e-2"]))
    trainer = Trainer(config=cfg)
    trainer.train()
    ids = next(iter(trainer.train_loader(0)))["input_ids"][:2]
    module = trainer.engine.module
    trainer.engine.eval()
    with torch.no_grad():
        reference = trainer.engine(input_ids=ids).logits
    base_targets, _ = adapters.base_tensors(module)
    models.save_hf(trainer, f"{a.out}/base", module.get_base_model(),
                   [models._tensor_entry(k, t) for k, t in base_targets.items()], "5GB")
    trainer.save_peft(f"{a.out}/adapter")
    ck.export_merged(trainer, f"{a.out}/merged")
    try:
        trainer.save_peft(f"{a.out}/nothing", selected_adapters=["nope"])
        unknown = None
    except ck.AdapterError as e:
        unknown = str(e)
    with torch.no_grad():  # wipe the adapter, then load it back
        lora = adapters.adapter_params(module, ["mine"])
        with GatheredParameters(lora, modifier_rank=0):
            for q in lora:
                q.data.zero_()
        wiped = (trainer.engine(input_ids=ids).logits - reference).abs().max().item()
        trainer.load_peft(f"{a.out}/adapter", adapter_name="mine")
        back = (trainer.engine(input_ids=ids).logits - reference).abs().max().item()
    if trainer.env.rank == 0:
        torch.save({"ids": ids, "logits": reference}, f"{a.out}/reference.pt")
    report(rank=trainer.env.rank, unknown=unknown, wiped=wiped, back=back,
           nothing_written=not Path(f"{a.out}/nothing").exists())
    trainer.close()


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
