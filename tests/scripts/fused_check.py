"""Train the default task with LOMO and AdaLomo through our Trainer on the launcher's ranks and
replay the same steps with a plain-PyTorch reference of the update rule; report both.

The reference is written here from the papers' update rules, independently of engine.lomo: an
ordinary Hugging Face model, ordinary `loss.backward()`, the gradient averaged over the ranks'
batches, clipped by its global norm, then the SGD (LOMO) or the factored-second-moment (AdaLomo)
update, parameter by parameter, with the learning rate the schedule gives.
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402


def full_weights(module) -> dict:
    """name -> full fp32 copy of every parameter (gathered under ZeRO-3)."""
    import deepspeed
    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_tensor")):
            out[name] = p.detach().float().clone()
    return out


def reference_adalomo(p, g, state, lr, eps=(1e-30, 1e-3), clip_threshold=1.0, decay=-0.8):
    import torch
    state["step"] = state.get("step", 0) + 1
    beta = 1.0 - state["step"] ** decay
    sq = g * g + eps[0]
    if p.dim() >= 2:
        state["r"] = beta * state.get("r", torch.zeros(p.shape[0])) + (1 - beta) * sq.mean(dim=1)
        state["c"] = beta * state.get("c", torch.zeros(p.shape[1])) + (1 - beta) * sq.mean(dim=0)
        v = torch.outer(state["r"] / state["r"].mean(), state["c"])
    else:
        state["v"] = beta * state.get("v", torch.zeros_like(p)) + (1 - beta) * sq
        v = state["v"]
    u = g / v.sqrt()
    u = u / max(1.0, float(u.pow(2).mean().sqrt()) / clip_threshold)
    scale = max(eps[1], float(p.pow(2).mean().sqrt()))
    return p - lr * scale * u


def replay(method, initial, config, steps, lrs, clip):
    """The reference run: returns (losses, final weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.load_state_dict({k: v for k, v in initial.items()}, strict=False)
    model.train()
    params = dict(model.named_parameters())
    states = {n: {} for n in params}
    losses = []
    for step_batches, lr in zip(steps, lrs):
        grads = {n: torch.zeros_like(p) for n, p in params.items()}
        step_loss = 0.0
        # one micro-batch per rank, weighed by its label tokens (the token-weighted objective:
        # the step's loss is the sum of the token losses over the ranks / their number)
        counts = [int(b["labels"][..., 1:].ne(-100).sum()) for b in step_batches]
        for batch, count in zip(step_batches, counts):
            model.zero_grad(set_to_none=True)
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            step_loss += float(loss) * count / sum(counts)
            for n, p in params.items():
                grads[n] += p.grad * (count / sum(counts))
        losses.append(step_loss)
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        with torch.no_grad():
            for n, p in params.items():
                g = grads[n] * coef
                new = p - lr * g if method == "lomo" else reference_adalomo(p, g, states[n], lr)
                p.copy_(new)
    return losses, {n: p.detach().clone() for n, p in params.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero", type=int, nargs="+", required=True,
                    help="one stage after the other, in this one process group")
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--methods", default="lomo,adalomo")
    ap.add_argument("--set-lr-at", type=int, default=0, help="after this step, trainer.set_lr(3 x current)")
    ap.add_argument("--local_rank", type=int, default=0)
    a = ap.parse_args()
    import torch
    import torch.distributed as dist
    from engine.callbacks import Callback
    from contract.config.load import load_config
    from engine.trainer import Trainer

    lrs_for = {"lomo": "5e-2", "adalomo": "1e-2"}
    for zero, method in [(z, m) for z in a.zero for m in a.methods.split(",")]:
        cfg = load_config(overrides=[
            f"method={method}", f"zero_stage={zero}", f"nproc={a.nproc}", f"max_steps={a.steps}",
            f"lr={lrs_for[method]}", "optim.grad_clip=1.0", "optim.warmup_steps=2", "optim.scheduler=cosine",
            "batch_size=8", "data.max_length=32", "precision=fp32", "eval.at_end=false",
            "checkpoint.save_at_end=false", "control.enabled=false", f"output_dir={a.out}",
            f"run_name={method}-{zero}-{a.nproc}"])
        losses, lrs, batches, asked = [], [], [], []

        class Record(Callback):
            def on_train_batch_begin(self, trainer, micro_batches):
                lrs.append(trainer.current_lr())   # the rate this step applies
                batches.append([{k: v.clone() for k, v in b.items()} for b in micro_batches])

            def on_train_batch_end(self, trainer, loss):
                losses.append(loss)
                if len(losses) == a.set_lr_at:  # as the control plane's set_lr does it
                    asked.append(3 * trainer.current_lr())
                    trainer.set_lr(asked[0])

        trainer = Trainer(config=cfg, callbacks=[Record()])
        initial = full_weights(trainer.engine.module)
        trainer.train()
        final = full_weights(trainer.engine.module)
        from engine.parallel.ds_config import release_transformers_zero3
        release_transformers_zero3()  # the reference is a plain model, not built partitioned
        # every rank's batches, step by step, for the reference
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, batches)
        steps = [[b for rank_batches in everyone for b in rank_batches[i]] for i in range(len(batches))]
        ref_losses, ref_final = replay(method, initial, trainer.engine.module.config, steps, lrs,
                                       cfg.optim.grad_clip)
        diff = max(float((final[n] - ref_final[n]).abs().max()) for n in ref_final)
        moved = max(float((final[n] - initial[n]).abs().max()) for n in ref_final)
        opt = trainer.optimizer
        state_numel = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
        report(zero=zero, rank=trainer.env.rank, method=method, losses=losses, ref_losses=ref_losses,
               lrs=lrs, weight_diff=diff, weight_moved=moved, state_numel=state_numel,
               params_numel=sum(p.numel() for p in final.values()),
               grads_left=sum(1 for q in trainer.engine.module.parameters() if q.grad is not None),
               digest=[float(final[n].double().sum()) for n in sorted(final)][:8],
               engine_optimizer=type(trainer.engine.optimizer).__name__, skipped=opt.skipped_steps,
               asked_lr=asked[0] if asked else None)
        trainer.close()


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
