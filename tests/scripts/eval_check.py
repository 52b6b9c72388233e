"""Train the default task a few steps on the launcher's ranks, run every evaluator, and compute
the same metrics on rank 0 with a plain copy of the model, one sample at a time; report both.

The evaluation file holds default-task rows with candidate answers (the three operations' results
for the row's word), an odd number of them so that the ranks' shares differ in size.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402


def write_eval_rows(path: Path, n: int) -> list[dict]:
    from engine.data import default_task as dt
    rows = []
    for row in dt.make_examples(n, seed=7, split="eval"):
        word = row["input"].split(": ", 1)[1].strip()
        choices = list(dict.fromkeys(op(word) for op in dt.OPERATIONS.values()))
        rows.append({**row, "choices": choices})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return rows


def plain_copy(trainer):
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from engine.parallel.ds_config import release_transformers_zero3

    weights = {}
    for name, p in trainer.engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_tensor")):
            weights[name] = p.detach().float().clone()
    release_transformers_zero3()
    model = AutoModelForCausalLM.from_config(trainer.engine.module.config, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    return model.eval()


def reference(model, tok, rows, max_new_tokens):
    """Perplexity, choice accuracy and greedy predictions, sample by sample, no padding."""
    import math
    import torch
    loss_sum = tokens = 0.0
    correct = 0
    predictions = []
    with torch.no_grad():
        for row in rows:
            prompt = tok(row["input"])["input_ids"]
            scores = []
            for choice in row["choices"]:
                answer = tok(choice, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids = torch.tensor([prompt + answer])
                logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
                picked = logprobs[len(prompt) - 1:, :].gather(-1, ids[0, len(prompt):, None])
                scores.append(-float(picked.sum()))
                if choice == row["output"]:
                    loss_sum += scores[-1]
                    tokens += len(answer)
            correct += row["choices"][scores.index(min(scores))] == row["output"]
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            predictions.append(tok.decode(out[0, len(prompt):], skip_special_tokens=True))
    return {"loss": loss_sum / tokens, "perplexity": math.exp(loss_sum / tokens),
            "accuracy": correct / len(rows)}, predictions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=21)
    ap.add_argument("--local_rank", type=int, default=0)
    a = ap.parse_args()
    from contract.config.load import load_config
    from engine.trainer import Trainer

    eval_path = Path(a.out) / "eval.jsonl"
    write_eval_rows(eval_path, a.rows)  # every rank, atomically: the same bytes
    max_new = 10
    cfg = load_config(overrides=[
        f"zero_stage={a.zero}", "nproc=2", "max_steps=12", "lr=3e-3", "batch_size=16",
        "data.max_length=32", "precision=fp32", f"data.eval={eval_path}", "eval.at_end=false",
        "eval.evaluators=[perplexity,choice,exact_match,generation]", "eval.batch_size=4",
        f"eval.max_new_tokens={max_new}", "checkpoint.save_at_end=false", "control.enabled=false",
        f"output_dir={a.out}", "run_name=ev"])
    trainer = Trainer(config=cfg)
    trainer.train()
    results = trainer.evaluate()
    model = plain_copy(trainer)  # collective (gathers under ZeRO-3)
    predictions, ref, ref_predictions, events = [], {}, [], []
    if trainer.env.rank == 0:
        path = trainer.folder.root / "predictions" / f"step-{trainer.state.global_step}.jsonl"
        predictions = [json.loads(line)["prediction"] for line in path.read_text().splitlines()]
        rows = [json.loads(line) for line in eval_path.read_text().splitlines()]
        ref, ref_predictions = reference(model, trainer.tokenizer, rows, max_new)
        trainer.close()
        events = [json.loads(line) for line in trainer.folder.events.read_text().splitlines()]
    report(rank=trainer.env.rank, results=results, reference=ref,
           predictions_match=predictions == ref_predictions, n_predictions=len(predictions),
           mismatches=[(p, q) for p, q in zip(predictions, ref_predictions) if p != q][:3],
           eval_events=[e for e in events if e.get("type") == "eval"][-1:])


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
