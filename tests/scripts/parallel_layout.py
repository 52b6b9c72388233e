"""Train the tiny default model under one layout (tp 2, pp 2, or one rank) and report what the
tp / pp tests compare: per-step losses, evaluation, a greedy chat at a step boundary next to a
one-rank Hugging Face model holding the same (gathered) weights, the merged Hugging Face
export with the engine's logits, and a training checkpoint to resume from.

Several layouts of one world size run one after the other in one launch (`--layouts a,b`: a
2-rank start costs more than a layout's steps), each in its own Trainers and folder OUT/<layout>;
a layout named in `--resume` is then resumed from its checkpoint in a new Trainer (reported as
`<layout>-resumed`), as a relaunch would. A tensor-parallel engine leaves DeepSpeed's process-wide
model-parallel groups behind, which a later engine without them cannot be built beside: data
parallel layouts come first."""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402

PROMPTS = ["reverse: kcodw\n", "sort: abc\n", "upper: hello\n"]
LAYOUTS = {"tp": ["nproc=2", "tp=2"], "pp": ["nproc=2", "pp=2"], "single": ["nproc=1"],
           "tp_zero2": ["nproc=2", "tp=2", "zero_stage=2"], "pp_zero1": ["nproc=2", "pp=2", "zero_stage=1"],
           "dp2": ["nproc=2", "zero_stage=1"], "dp2_tp2": ["nproc=4", "tp=2", "zero_stage=1"],
           "dp2_pp2": ["nproc=4", "pp=2", "zero_stage=1"]}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True, help=f"comma-separated, of {sorted(LAYOUTS)}")
    p.add_argument("--out", required=True, help="each layout's files go to OUT/<layout>")
    p.add_argument("--data", required=True, help="JSON {train, eval} paths")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--chat-step", type=int, default=3)
    p.add_argument("--ckpt-step", type=int, default=4)
    p.add_argument("--resume", default="", help="comma-separated layouts resumed right after their run")
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def main() -> None:
    a = parse()
    data = json.loads(a.data)
    resumed = set(filter(None, a.resume.split(",")))
    for layout in a.layouts.split(","):
        out = Path(a.out) / layout
        report(layout=layout, **run(a, layout, out, data, resume=""))
        if layout in resumed:
            report(layout=f"{layout}-resumed", **run(a, layout, out, data, resume=str(out / "ckpt")))


def run(a: argparse.Namespace, layout: str, out: Path, data: dict, resume: str) -> dict:
    """One run of `layout` (from the checkpoint `resume`, when given): what this rank reports."""
    import torch

    from engine.callbacks import Callback
    from contract.config.load import load_config
    from engine.generation.generate import encode_prompts, generate
    from engine.parallel import layouts
    from engine.trainer import Trainer

    cfg = load_config(overrides=[
        *LAYOUTS[layout], "precision=fp32", f"max_steps={a.steps}", "batch_size=8", "train.grad_accum=2",
        "data.max_length=32", "lr=3e-3", "optim.warmup_steps=2", f"data.train={data['train']}",
        f"data.eval={data['eval']}", "eval.at_end=true", "eval.max_samples=16", "eval.batch_size=8",
        "eval.evaluators=perplexity,exact_match", "eval.max_new_tokens=8", "checkpoint.save_at_end=false",
        "control.enabled=false", "logging.tensorboard=false", f"output_dir={out / 'runs'}",
        f"run_name={layout}{'-resumed' if resume else ''}"])
    losses, chats, evals = {}, {}, {}

    class Probe(Callback):
        def on_train_batch_end(self, trainer, loss):
            step = trainer.state.global_step
            losses[step] = loss
            if step == a.chat_step and not resume:
                chats.update(chat_against_one_rank(trainer))
            if step == a.ckpt_step and not resume:
                trainer.save_checkpoint(str(out / "ckpt"))

        def on_evaluate_end(self, trainer, results):
            evals.update(results)

    def chat_against_one_rank(trainer) -> dict:
        texts = generate(trainer, PROMPTS, max_new_tokens=12)  # collective, every rank
        sampled = generate(trainer, PROMPTS, max_new_tokens=12, temperature=1.0, seed=7)
        streamed: list[str] = []
        first = generate(trainer, PROMPTS[:1], max_new_tokens=12, on_text=streamed.append)[0]
        state = layouts.full_state_dict(trainer)  # collective; rank 0 gets the whole model
        ref = ref_sampled = None
        if trainer.env.rank == 0:
            model = one_rank_model(trainer, state)
            ref = hf_generate(model, trainer.tokenizer, do_sample=False)
            ref_sampled = hf_generate(model, trainer.tokenizer, do_sample=True, seed=7)
        return {"texts": texts, "reference": ref, "sampled": sampled, "reference_sampled": ref_sampled,
                "streamed": "".join(streamed), "first": first}

    def hf_generate(model, tok, do_sample: bool, seed: int = 0) -> list[str]:
        """Plain transformers generation on this process (sampling: the same seed and RNG)."""
        enc = encode_prompts(tok, PROMPTS, "cpu")
        with torch.no_grad():
            torch.manual_seed(seed)
            ids = model.generate(**enc, max_new_tokens=12, do_sample=do_sample, top_k=None,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        return tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)

    trainer = Trainer(config=cfg, callbacks=[Probe()])
    if resume:
        trainer.load_checkpoint(resume)
    trainer.train()
    loaded = None
    if not resume:
        trainer.save_model(str(out / "model"))  # engine.checkpoint, merged by engine.parallel.layouts
        save_engine_logits(trainer, out / "engine_logits.pt")
        loaded = load_halved_weights(trainer, out)
    result = dict(rank=trainer.env.rank, losses=losses, eval=evals, chat=chats, dp_rank=trainer.env.dp_rank,
                  dp_size=trainer.env.dp_size, stage=trainer.env.stage, tp_rank=trainer.env.tp_rank,
                  parameters=getattr(trainer.engine.module, "whole_model_parameters", (None,))[0],
                  loaded_round_trip=loaded)
    trainer.close()
    return result


def one_rank_model(trainer, state: dict):
    from transformers import AutoModelForCausalLM
    from engine.parallel.layouts import hf_config_of
    model = AutoModelForCausalLM.from_config(hf_config_of(trainer), dtype=state["model.embed_tokens.weight"].dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not [k for k in missing if k != "lm_head.weight"] and not unexpected, (missing, unexpected)
    return model.eval()


def load_halved_weights(trainer, out: Path) -> dict:
    """trainer.load_model of a Hugging Face folder holding the saved model's weights halved
    (split into this layout), after a folder lacking one tensor was refused; returns the refusal
    and (rank 0) whether gathering the weights again gives exactly the halved ones. The engine's
    logits afterwards go to engine_logits_loaded.pt."""
    import shutil

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from engine.parallel import layouts
    halved = {k: v * 0.5 for k, v in load_file(str(out / "model" / "model.safetensors")).items()}
    broken = {k: v for k, v in halved.items() if k != "model.norm.weight"}
    if trainer.env.rank == 0:
        for name, weights in (("halved", halved), ("broken", broken)):
            shutil.copytree(out / "model", out / name, ignore=shutil.ignore_patterns("*.safetensors", "COMPLETE*"))
            save_file(weights, str(out / name / "model.safetensors"), metadata={"format": "pt"})
    if trainer.env.world_size > 1:
        dist.barrier()
    from engine.checkpoint import ModelLoadError
    try:
        trainer.load_model(str(out / "broken"))
        refused = None
    except ModelLoadError as e:  # checked before any weight changes, the same on every rank
        refused = str(e)
    trainer.load_model(str(out / "halved"))
    save_engine_logits(trainer, out / "engine_logits_loaded.pt")
    again = layouts.full_state_dict(trainer)
    if again is None:
        return {"refused": refused}
    return {"refused": refused, "round_trip": all(torch.equal(again[k], v) for k, v in halved.items())}


def save_engine_logits(trainer, path: Path) -> None:
    """The engine's own logits for fixed prompts, written by the rank that has them."""
    import torch
    from engine.generation.generate import encode_prompts
    enc = encode_prompts(trainer.tokenizer, PROMPTS, trainer.engine.device)
    with torch.no_grad():
        trainer.engine.eval()
        if trainer.env.pp_size > 1:
            from engine.parallel.pipeline import pipe_inputs, stage_forward
            logits = stage_forward(trainer.engine, pipe_inputs(enc, trainer.engine.device)[0])
        else:
            logits = trainer.engine(**enc, use_cache=False).logits
    if logits is not None and (trainer.env.pp_size > 1 or trainer.env.rank == 0):
        torch.save({"logits": logits.cpu(), **{k: v.cpu() for k, v in enc.items()}}, path)


if __name__ == "__main__":
    main()
    # Every result is written: end without the interpreter's teardown, as engine/worker.py does
    # (a 4-rank pipeline rank once aborted there after all its work: "terminate called without an
    # active exception", a communication thread destroyed at exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
