"""Train the default task with PEFT methods through our Trainer on the launcher's ranks; report
the losses, how far base and adapter weights moved, and whether the adapter saved with
`trainer.save_peft` and loaded back by peft into a plain model gives the engine's logits.

`--runs 0=lora,p_tuning 3=lora` trains each method under each ZeRO stage named, one Trainer
after the other in the same process group (one launch instead of one per stage)."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402


def full_weights(module) -> dict:
    import deepspeed
    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_tensor")):
            out[name] = p.detach().float().clone()
    return out


def moved(before: dict, after: dict, names) -> float:
    return max((float((after[n] - before[n]).abs().max()) for n in names), default=0.0)


def probe_batch(tokenizer):
    import torch
    enc = tokenizer(["reverse: abcde\nedcba", "upper: xyz\nXYZ"], return_tensors="pt", padding=True)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def reload_logits(trainer, weights: dict, folder: str, probe: dict):
    """A plain (unpartitioned) base model with the engine's base weights, the adapter loaded by
    peft from `folder`, and its logits on `probe`."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM
    from engine.parallel.ds_config import release_transformers_zero3

    release_transformers_zero3()  # a plain model, not built partitioned
    base = AutoModelForCausalLM.from_config(trainer.engine.module.get_base_model().config, dtype=torch.float32)
    # the base model's own names of the engine's parameters (LoRA layers sit inside it)
    names = {id(p): n for n, p in trainer.engine.module.get_base_model().named_parameters()}
    base_state = {names[id(p)].replace(".base_layer.", "."): weights[n]
                  for n, p in trainer.engine.module.named_parameters()
                  if id(p) in names and "lora_" not in names[id(p)]}
    missing = [k for k in base.load_state_dict(base_state, strict=False).missing_keys if "lm_head" not in k]
    assert not missing, missing
    name = trainer.config.method.adapter_name  # peft saves a non-default adapter in a sub-folder
    model = peft.PeftModel.from_pretrained(base, str(Path(folder) / name), adapter_name=name)
    model.eval()
    with torch.no_grad():
        return model(**probe).logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", required=True, help="ZERO=METHOD[,METHOD...] for each stage")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--local_rank", type=int, default=0)
    a = ap.parse_args()
    import torch
    from engine.callbacks import Callback
    from contract.config.load import load_config
    from engine.trainer import Trainer

    lr = {"lora": "1e-2", "prompt_tuning": "1e-1", "p_tuning": "1e-2"}
    runs = [(int(zero), method)
            for zero, methods in (r.split("=") for r in a.runs) for method in methods.split(",")]
    for zero, method in runs:
        cfg = load_config(overrides=[
            f"method={method}", f"zero_stage={zero}", "nproc=2", f"max_steps={a.steps}", f"lr={lr[method]}",
            "method.adapter_name=mine", "batch_size=16", "data.max_length=32", "optim.warmup_steps=2",
            "precision=fp32", "eval.at_end=false", "checkpoint.save_at_end=false", "control.enabled=false",
            f"output_dir={a.out}", f"run_name={method}-{zero}"])
        losses = []

        class Record(Callback):
            def on_train_batch_end(self, trainer, loss):
                losses.append(loss)

        trainer = Trainer(config=cfg, callbacks=[Record()])
        module = trainer.engine.module
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        before = full_weights(module)
        trainer.train()
        after = full_weights(module)
        frozen = [n for n in after if n not in trainable]
        folder = str(Path(a.out) / f"adapter-{method}-{zero}")
        trainer.save_peft(folder)
        probe = probe_batch(trainer.tokenizer)
        module.eval()
        with torch.no_grad():  # collective under ZeRO-3: every rank runs it
            engine_logits = trainer.engine(**{k: v.to(trainer.engine.device) for k, v in probe.items()}).logits.float()
        reloaded = reload_logits(trainer, after, folder, probe)
        report(zero=zero, rank=trainer.env.rank, method=method, losses=losses, trainable=trainable[:4],
               only_adapter=all(f".{cfg.method.adapter_name}." in n for n in trainable),
               trainable_numel=sum(after[n].numel() for n in trainable),
               total_numel=sum(w.numel() for w in after.values()),
               frozen_moved=moved(before, after, frozen), adapter_moved=moved(before, after, trainable),
               reload_diff=float((engine_logits.cpu() - reloaded).abs().max()),
               saved=sorted(p.name for p in (Path(folder) / "mine").iterdir()),
               engine_optimizer=type(trainer.engine.optimizer).__name__)
        trainer.close()


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
