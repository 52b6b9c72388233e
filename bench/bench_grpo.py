"""GRPO: step time against TRL's GRPOTrainer (use_vllm=False), and peak memory against SFT.

Speed, one rank, under the DeepSpeed launcher (as bench_preference_trl.py):

    OMP_NUM_THREADS=1 .venv/bin/deepspeed --num_gpus 1 bench/bench_grpo.py speed \
        [--steps 12] [--prompts 4] [--generations 8] [--max-new 16] [--first ours|trl]

The same small Llama (bench_preference_trl.inputs: hidden 256, 4 layers, the default task's
character tokenizer), the default task's prompt rows in the order our sampler draws them (TRL's
sampler unshuffled), the same GRPO settings (dapo, beta 0, temperature 1, exact match against
`answer`), the same DeepSpeed config (ours, resolved; ZeRO 0), fp32. Each trainer's step is
timed from its step-begin to its step-end callback and split into generate (the sampling of
every answer), score (the reward functions) and train (the rest: log-probabilities, loss,
backward, optimizer step; TRL's rest also holds its bookkeeping of the batch). Printed: the
median over the steps after the first two, samples (answers) per second of each and the ratio
(ours / TRL's; target at least 1.0), each one's mean answer length (the two sample with their own
generators, so their answers differ), and the CPU time a step takes (every thread; with
OMP_NUM_THREADS=1 the work done, whatever the machine's load).

Memory, each case in a fresh process (bench_methods.child_result's way):

    .venv/bin/python bench/bench_grpo.py memory [--hidden 512 --layers 8 --vocab 32000]

GRPO with beta 0 under LoRA against SFT under LoRA on the same tokens: bench_preference_memory's
model (random weights, `--vocab` wide head, so sampled answers rarely end early) and prompts;
GRPO samples `--generations` answers of `--max-new` tokens to each of `--prompts` prompts a step;
SFT trains `--prompts x --generations` rows, each a prompt and an answer of that many tokens.
Memory is CUDA's peak allocated on a GPU and, here, the process's peak resident set size
(sampled every 2 ms) above its size just before the Trainer is built: model, adapter, optimizer,
activations, the KV cache of the sampling, and what glibc's allocator keeps cached (target: GRPO
at most 1.1 x SFT).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_methods import child_result  # noqa: E402  (beside this file)
from bench_preference_memory import make_assets, measured_train  # noqa: E402
from bench_preference_trl import StepClock, inputs  # noqa: E402

PHASES = ("generate", "score")  # timed inside the step; "train" is the rest
LR = 1e-4


class PhaseClock(StepClock):
    """StepClock with each step's time in the wrapped phases (the rest is `train`)."""

    def __init__(self):
        super().__init__()
        self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
        self.lengths: list[float] = []

    def begin(self) -> None:
        for spent in self.phases.values():
            spent.append(0.0)
        super().begin()

    def timed(self, phase: str, fn: Callable) -> Callable:
        """`fn`, its time added to this step's `phase`."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.phases[phase][-1] += time.perf_counter() - start
        return wrapper

    def split(self) -> dict[str, float]:
        """Median seconds of each phase over the steps after the first two."""
        out = {p: statistics.median(v[2:]) for p, v in self.phases.items()}
        out["train"] = statistics.median(w - sum(self.phases[p][i] for p in PHASES)
                                         for i, w in enumerate(self.wall) if i >= 2)
        return out


def exact_match_reward():
    """Our built-in exact match on `answer`, named for TRL's metrics."""
    from contract.rewards import exact_match
    fn = exact_match("answer")
    fn.__name__ = "exact_match"
    return fn


def ours_speed(work: Path, a, clock: PhaseClock):
    """Our Trainer (not trained yet), its steps' phases timed; its row order and DeepSpeed config."""
    from contract.config.load import load_config
    from engine.callbacks import Callback
    from engine.trainer import Trainer
    cfg = load_config(overrides=[
        f"model.path={work / 'model'}", f"data.train={work / 'prompts.jsonl'}", "objective=grpo",
        f"grpo.num_generations={a.generations}", f"grpo.max_completion_length={a.max_new}", "grpo.loss_type=dapo",
        "grpo.temperature=1.0", "grpo.rewards=[{kind: exact_match, column: answer}]",
        f"max_steps={a.steps}", f"batch_size={a.prompts}", f"lr={LR}", "optim.scheduler=constant",
        "optim.weight_decay=0", "precision=fp32", "data.batching=random", "eval.at_end=false",
        "checkpoint.save_at_end=false", "control.enabled=false", "logging.tensorboard=false",
        f"output_dir={work / 'runs'}"])

    class Clock(Callback):
        def on_train_batch_begin(self, trainer, batch):
            clock.begin()

        def on_train_batch_end(self, trainer, loss):
            clock.end()
            clock.lengths.append(trainer.train_fn.metrics["completions/mean_length"])

    trainer = Trainer(config=cfg, callbacks=[Clock()])
    step = trainer.train_fn
    step.sample, step._score = clock.timed("generate", step.sample), clock.timed("score", step._score)
    order = [int(i) for b in trainer.train_loader(0).batch_sampler for i in b][: a.steps * a.prompts]  # indices
    return trainer, order, dict(trainer.ds_setup.config)


def trl_speed(work: Path, a, rows: list[dict], ds: dict, clock: PhaseClock) -> None:
    """TRL's GRPOTrainer on `rows` in that order, its steps' phases timed."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.begin()

        def on_step_end(self, args, state, control, **kw):
            clock.end()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                clock.lengths.append(logs["completions/mean_length"])

    samples = a.prompts * a.generations  # TRL's batch counts answers
    ds = {**ds, "train_micro_batch_size_per_gpu": samples, "train_batch_size": samples}
    args = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=samples,
                      num_generations=a.generations, max_completion_length=a.max_new, loss_type="dapo", beta=0.0,
                      temperature=1.0, max_steps=a.steps, learning_rate=LR, lr_scheduler_type="constant",
                      weight_decay=0.0, bf16=False, fp16=False, deepspeed=ds, logging_steps=1, save_strategy="no",
                      report_to=[], use_cpu=not __import__("torch").cuda.is_available(), shuffle_dataset=False,
                      gradient_checkpointing=False, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"))
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_match_reward()], args=args,
                          train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(str(work / "model")), callbacks=[Clock()])
    trainer._generate = clock.timed("generate", trainer._generate)
    trainer._calculate_rewards = clock.timed("score", trainer._calculate_rewards)
    trainer.train()


def speed(a) -> None:
    import torch
    from engine.data.default_task import make_examples, prompt_row
    mine, theirs = PhaseClock(), PhaseClock()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs(work, 0)  # the model and tokenizer (and pairs, unused), from the default task's rows
        rows = [prompt_row(r) for r in make_examples(2000, 7)]
        (work / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        trainer, order, ds = ours_speed(work, a, mine)
        if a.first == "trl":
            trl_speed(work, a, [rows[i] for i in order], ds, theirs)
        trainer.train()
        trainer.close()
        if a.first == "ours":
            trl_speed(work, a, [rows[i] for i in order], ds, theirs)
    samples = a.prompts * a.generations
    print(f"\nGRPO (dapo, beta 0), {a.steps} steps of {a.prompts} prompts x {a.generations} answers of at most "
          f"{a.max_new} tokens, Llama hidden 256 x 4 layers, 1 rank, ZeRO 0, fp32, {a.first} first, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print("| | step (s) | generate | score | train | samples/s | ratio (ours / TRL) | mean answer tokens "
          "| CPU s / step | blocking waits / step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    trl_step = theirs.medians()[0]
    for name, clock in (("ours", mine), ("TRL GRPOTrainer", theirs)):
        wall, cpu, waits = clock.medians()
        split = clock.split()
        print(f"| {name} | {wall:.3f} | {split['generate']:.3f} | {split['score']:.4f} | {split['train']:.3f} "
              f"| {samples / wall:.1f} | {trl_step / wall:.2f} | {statistics.mean(clock.lengths):.1f} | {cpu:.3f} | {waits:.0f} |")


def memory_child(a) -> None:
    """One case (sft or grpo), LoRA, ZeRO 0: prints one RESULT line."""
    from contract.config.load import load_config
    grpo = a.child == "grpo"
    objective = ["objective=grpo", f"grpo.num_generations={a.generations}", f"grpo.max_completion_length={a.max_new}",
                 "grpo.beta=0", "grpo.rewards=[{kind: exact_match, column: answer}]"] if grpo else ["objective=sft"]
    cfg = load_config(overrides=[
        f"model.path={a.model}", f"data.train={a.data}", "method=lora", "zero_stage=0", *objective,
        f"max_steps={a.steps}", f"batch_size={a.prompts if grpo else a.prompts * a.generations}",
        f"data.max_length={a.seq + a.max_new}", "data.batching=random", f"precision={a.precision}",
        "optim.warmup_steps=0", "eval.at_end=false", "eval.every_n_steps=0", "checkpoint.save_at_end=false",
        "control.enabled=false", "logging.tensorboard=false", f"output_dir={a.out}", f"run_name={a.child}-{os.getpid()}"])
    peak, train = measured_train(cfg)
    print("RESULT " + json.dumps({
        **peak, "tokens": sum(e["tokens"] for e in train) / len(train),
        "answer_tokens": statistics.mean(e.get("completions/mean_length", 0.0) for e in train)}), flush=True)


def memory(a) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a.pairs = a.rows  # bench_preference_memory's prompts: a third of `seq` characters each
        model, pairs, _ = make_assets(root, a)
        prompts = [json.loads(line)["prompt"] for line in pairs.read_text().splitlines()]
        # the answers SFT trains: max_new tokens with the end token (a character each)
        answer = ("abcdefghij" * a.max_new)[: a.max_new - 1]
        (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": answer}) + "\n"
                                                    for p in prompts))
        (root / "rows.jsonl").write_text("".join(json.dumps({"input": p, "output": answer}) + "\n" for p in prompts))
        results = {}
        for case, data in (("sft", "rows.jsonl"), ("grpo", "prompts.jsonl")):
            cmd = [sys.executable, __file__, "memory", "--child", case, "--model", str(model),
                   "--data", str(root / data), "--out", str(root / "runs"), *_shared(a)]
            results[case] = child_result(cmd, case)
    sft = results["sft"]
    print(f"\nLlama hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, LoRA, ZeRO 0, {a.precision}, "
          f"{a.prompts} prompts x {a.generations} answers of {a.max_new} tokens a step (SFT: "
          f"{a.prompts * a.generations} rows), load average {os.getloadavg()[0]:.1f}; memory: {sft['memory']}\n")
    print("| objective | peak memory (MiB) | x SFT | tokens a step | mean answer tokens (GRPO) |\n|---|---|---|---|---|")
    for name, r in (("sft", sft), ("grpo, beta 0", results["grpo"])):
        print(f"| {name} | {r['peak_mib']:.0f} | {r['peak_mib'] / sft['peak_mib']:.2f} | {r['tokens']:.0f} "
              f"| {_length(r['answer_tokens'])} |")


def _length(tokens: float) -> str:
    return f"{tokens:.1f}" if tokens else "-"


def _shared(a) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
            ("prompts", "generations", "max_new", "seq", "steps", "precision")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=["speed", "memory"])
    p.add_argument("--steps", type=int, default=None, help="steps (speed: 12, memory: 3)")
    p.add_argument("--prompts", type=int, default=4, help="prompts a step")
    p.add_argument("--generations", type=int, default=8, help="answers per prompt")
    p.add_argument("--max-new", type=int, default=None, help="most tokens an answer (speed: 16, memory: 64)")
    p.add_argument("--first", default="ours", choices=["ours", "trl"], help="speed: which trainer trains first")
    p.add_argument("--hidden", type=int, default=512), p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8), p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=96, help="memory: the prompts' length is a third of it")
    p.add_argument("--rows", type=int, default=64, help="memory: prompts in the file")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--child", choices=["sft", "grpo"], help=argparse.SUPPRESS)
    p.add_argument("--model"), p.add_argument("--data"), p.add_argument("--out")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    a.steps = a.steps or (12 if a.part == "speed" else 3)
    a.max_new = a.max_new or (16 if a.part == "speed" else 64)
    if a.child:
        return memory_child(a)
    (speed if a.part == "speed" else memory)(a)


if __name__ == "__main__":
    main()
