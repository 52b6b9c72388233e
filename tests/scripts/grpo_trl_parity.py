"""GRPO against TRL's GRPOTrainer (use_vllm=False) on the same model, data, settings and
DeepSpeed config, under the DeepSpeed launcher (1 or 2 ranks): TRL trains first, and every rank
records the samples TRL drew and scored (its generation batches, before any shuffle); our Trainer
then trains the same steps with those samples replayed into its step in place of its own
sampling (a test-only subclass of GrpoStep), so the comparison is of the objective: per-step
loss and every metric TRL logs that we log. Several cases (--cases LOSS:SCALE,...) run one after
the other in one launch, each from a fresh TRL trainer and Trainer; each prints one RESULT line
with its loss, scale and the path of a JSON file {"ours": [...], "trl": [...]}, one dict per step.

TRL shuffles a generation batch's rows before cutting it into micro-batches; here that shuffle is
the identity (in TRL's module only), so that TRL's micro-batch k is the k-th slice of the batch,
each group's answers together, as ours are."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from dist_utils import report  # noqa: E402

G, PROMPTS, MAX_NEW, LR = 4, 2, 5, 2e-2  # answers per prompt, prompts per micro-batch
TEMPERATURE, EPSILON, EPSILON_HIGH = 1.3, 0.1, 0.15
REWARDS = '''
def exact_match(prompts, completions, answer, **kwargs):
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]


def has_letter(prompts, completions, **kwargs):  # None: answers it does not score (by content alone:
    # TRL scores a whole generation batch at once, we a micro-batch)
    return [None if len(c) % 4 == 1 else sum(ch in "aeiou" for ch in c) / 3 for c in completions]
'''


def settings(a) -> list[str]:
    return [f"grpo.loss_type={a.loss}", f"grpo.beta={a.beta}", f"grpo.num_iterations={a.iterations}",
            f"grpo.num_generations={G}", f"grpo.max_completion_length={MAX_NEW}", f"grpo.temperature={TEMPERATURE}",
            f"grpo.epsilon={EPSILON}", f"grpo.epsilon_high={EPSILON_HIGH}", f"grpo.scale_rewards={a.scale}"]


def build_ours(work: Path, a, callbacks: list):
    from contract.config.load import load_config
    from engine.trainer import Trainer
    cfg = load_config(overrides=[
        f"model.path={work / 'model'}", f"data.train={work / 'prompts.jsonl'}", "objective=grpo", *settings(a),
        f"grpo.rewards=[{{kind: exact_match, name: exact_match}}, {{function: '{work}/parity_rewards.py:has_letter'}}]",
        f"max_steps={a.steps}", f"batch_size={PROMPTS}", f"train.grad_accum={a.accum}", f"lr={LR}",
        "optim.scheduler=constant", "optim.weight_decay=0", f"zero_stage={a.zero}", "precision=fp32",
        "checkpoint.save_at_end=false", "control.enabled=false", "logging.tensorboard=false",
        f"output_dir={work / 'runs'}", f"nproc={os.environ['WORLD_SIZE']}"])
    return Trainer(config=cfg, callbacks=callbacks)


def run_trl(work: Path, a, ds: dict) -> tuple[list[dict], list[dict]]:
    """TRL's logged steps and this rank's generation batches (prompts and tensors)."""
    import trl.trainer.grpo_trainer as grpo_module
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from engine.model.loading import load_tokenizer

    spec = importlib.util.spec_from_file_location("parity_rewards", work / "parity_rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    grpo_module.shuffle_sequence_dict = lambda batch: batch  # micro-batch k = the batch's k-th slice
    logged: list[dict] = []
    generations: list[dict] = []

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged.append(dict(logs))

    args = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=PROMPTS * G,
                      gradient_accumulation_steps=a.accum, num_generations=G, max_completion_length=MAX_NEW,
                      num_iterations=a.iterations, beta=a.beta, loss_type=a.loss, scale_rewards=a.scale,
                      temperature=TEMPERATURE, epsilon=EPSILON, epsilon_high=EPSILON_HIGH, max_steps=a.steps,
                      learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                      bf16=False, fp16=False, deepspeed=ds, logging_steps=1, save_strategy="no", report_to=[],
                      use_cpu=not torch.cuda.is_available(), seed=0, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"))  # after args: ZeRO-3 partitions it
    rows = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
    trainer = GRPOTrainer(model=model, reward_funcs=[rewards.exact_match, rewards.has_letter], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=load_tokenizer(work / "model"),
                          callbacks=[Log()])
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        out = generate(inputs)
        generations.append({"prompts": [x["prompt"] for x in inputs],
                            **{k: out[k].detach().cpu() for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                  "completion_mask")}})
        return out
    trainer._generate_and_score_completions = recorded
    trainer.train()
    return logged, generations


def replaying(step, generations: list[dict], tokenizer, index_of: dict, iterations: int) -> None:
    """Make our step train TRL's samples: step n (from 0) trains generation n // iterations, its
    micro-batch k being the generation's k-th slice (a test-only subclass, set on the object)."""
    from engine.generation.generate import end_ids
    from engine.objectives.grpo_step import GrpoStep, Samples
    ends = end_ids(tokenizer)

    def samples_of(gen: dict, k: int, width: int) -> Samples:
        rows = slice(k * width, (k + 1) * width)
        cids, cmask = gen["completion_ids"][rows], gen["completion_mask"][rows]
        ids = [r[m.bool()].tolist() for r, m in zip(cids, cmask)]
        return Samples(gen["prompt_ids"][rows], gen["prompt_mask"][rows], cids, cmask,
                       tokenizer.batch_decode(ids, skip_special_tokens=True), ids,
                       [not r or r[-1] not in ends for r in ids], [index_of[p] for p in gen["prompts"][rows]])

    class Replay(GrpoStep):
        def __call__(self, trainer, micro_batches):
            gen, width = generations[trainer.state.global_step // iterations], PROMPTS * G
            replayed = [samples_of(gen, k, width) for k in range(len(micro_batches))]
            batches = [{"index": torch.tensor(s.indices[::G]), "replay": s} for s in replayed]
            return super().__call__(trainer, batches)

        def sample(self, trainer, batch, micro):
            return batch["replay"]

    step.__class__ = Replay


def run_case(work: Path, a) -> Path:
    """One case (a loss type and a reward scaling): TRL trains, ours replays its samples; on rank 0
    the JSON file of both runs' steps."""
    from engine.callbacks import Callback
    steps: list[dict] = []

    class Record(Callback):
        def on_train_batch_end(self, tr, loss):
            steps.append({"loss": loss, **tr.train_fn.metrics})

    ours = build_ours(work, a, [Record()])  # first: TRL runs under the DeepSpeed config ours resolved
    ds = dict(ours.ds_setup.config)  # in TRL's units: a micro-batch counts answers, not prompts
    ds.update(train_micro_batch_size_per_gpu=PROMPTS * G,
              train_batch_size=PROMPTS * G * a.accum * int(os.environ["WORLD_SIZE"]))
    theirs, generations = run_trl(work, a, ds)
    dataset = ours.train_dataset
    index_of = {prompt: i for i, prompt in enumerate(dataset.prompts)}
    replaying(ours.train_fn, generations, ours.tokenizer, index_of, a.iterations)
    ours.train()
    ours.close()
    out = work / f"grpo-parity-{os.environ['WORLD_SIZE']}-{a.zero}-{a.iterations}-{a.loss}-{a.scale}.json"
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"ours": steps, "trl": theirs, "generations": len(generations)}))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cases", default="dapo:group",
                   help="comma-separated LOSS:SCALE pairs, run one after the other in this launch "
                        "(one process start for several cases)")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    work = Path(a.work)
    for case in a.cases.split(","):
        a.loss, _, a.scale = case.partition(":")
        AcceleratorState._reset_state(reset_partial_state=False)  # each case's TRL trainer: its own
        GradientState._reset_state()  # accelerator state (the process group stays)
        out = run_case(work, a)
        if dist.get_rank() == 0:
            report(loss=a.loss, scale=a.scale, path=str(out))
    dist.barrier()


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
