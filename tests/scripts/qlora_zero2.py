"""LoRA on a 4-bit base on the launcher's 2 ranks under ZeRO-2: train the default task, chat
with the live weights (collective), report the losses and the answer."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    from contract.config.load import load_config
    from engine.callbacks import Callback
    from engine.generation.generate import generate
    from engine.trainer import Trainer

    cfg = load_config(overrides=["model.quantization=4bit", "method=lora", "zero_stage=2", "nproc=2",
                                 "max_steps=12", "lr=1e-1", "batch_size=8", "data.max_length=32",
                                 "precision=fp32", "eval.at_end=false", "checkpoint.save_at_end=false",
                                 "control.enabled=false", f"output_dir={a.out}", "run_name=q"])
    losses = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, loss):
            losses.append(loss)

    trainer = Trainer(config=cfg, callbacks=[Record()])
    layer = type(trainer.engine.module.get_base_model().model.layers[0].self_attn.q_proj.base_layer).__name__
    trainer.train()
    ids: list = []
    answer = generate(trainer.ctx, ["1+1="], max_new_tokens=4, on_ids=ids.extend)
    report(rank=trainer.env.rank, losses=losses, layer=layer, answer=answer[0], new_ids=ids[0])
    trainer.close()


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
