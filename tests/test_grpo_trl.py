"""GRPO against the reference implementation, TRL's GRPOTrainer (use_vllm=False), in fp32.

* The objective, 1 rank: TRL samples and scores a batch; the same completions, decoded, scored by
  our reward functions give TRL's advantages, and our loss of the same tensors with our forward
  gives TRL's `_compute_loss` and its metrics, for each loss type (with beta > 0 against a moved
  policy, so that the KL term is not zero).
* Whole runs, under the DeepSpeed launcher (tests/scripts/grpo_trl_parity.py): TRL trains, its
  samples are recorded and replayed into our Trainer's step, and every step's loss and metrics
  agree -- on 2 ranks under ZeRO-3 with gradient accumulation (every loss type, one after the other
  in one launch), and with num_iterations 2 (the samples reused with importance ratios: the second
  iteration's loss and clip metrics depend on the first's update) on 1 rank and on 2."""

import json

import pytest
import torch

from dist_utils import SCRIPTS, parse_results, run_deepspeed

pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # one TRL trainer built (~40-60 s on 2 loaded cores)

G, PROMPTS, MAX_NEW = 4, 3, 6


def exact_match_fn(prompts, completions, answer, **kwargs):  # TRL's form of our built-in
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]


def has_letter_fn(prompts, completions, **kwargs):  # a reward with None: rows it does not score
    return [None if i % 5 == 0 else sum(ch in "aeiou" for ch in c) / 3 for i, c in enumerate(completions)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """One TRL trainer (with a reference model: beta > 0 at construction); each case sets its
    loss type, beta and scaling on it, as its constructor would from GRPOConfig."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from conftest import save_tiny_llama
    from engine.data.default_task import make_examples, prompt_row
    folder = tmp_path_factory.mktemp("grpo_trl")
    save_tiny_llama(folder / "model")
    rows = [prompt_row(r) for r in make_examples(PROMPTS, seed=3)]
    tok = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
    args = GRPOConfig(output_dir=str(folder / "out"), per_device_train_batch_size=G * PROMPTS,
                      num_generations=G, max_completion_length=MAX_NEW, beta=0.04, temperature=1.3,
                      report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", seed=0,
                      epsilon=0.1, epsilon_high=0.15)
    trainer = GRPOTrainer(model=model, reward_funcs=[exact_match_fn, has_letter_fn], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets: one micro-batch a step
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    return folder, rows, trainer, initial


@pytest.mark.parametrize("loss_type,beta,scale", [("grpo", 0.0, "group"), ("dr_grpo", 0.0, "none"),
                                                  ("dapo", 0.04, "group"), ("bnpo", 0.04, "batch")])
def test_objective_matches_trl(setup, loss_type, beta, scale):
    from transformers import AutoModelForCausalLM

    from contract.config.schema import GrpoConfig
    from contract.rewards import Reward, build_reward
    from engine.objectives.grpo import advantages_of
    from engine.objectives.grpo_step import GrpoStep
    from engine.objectives.rewards import metrics_of, score, total

    folder, rows, trainer, initial = setup
    trainer.model.load_state_dict(initial)
    trainer.model.zero_grad(set_to_none=True)
    trainer.loss_type, trainer.beta, trainer.scale_rewards = loss_type, beta, scale
    torch.manual_seed(0)
    trainer.model.train()
    trainer._logs["completion"].clear()
    batch = [dict(r) for r in rows for _ in range(G)]  # TRL's sampler repeats each prompt G times
    out = trainer._generate_and_score_completions(batch)
    completions = list(trainer._logs["completion"])
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # rewards and advantages: our functions on TRL's decoded completions
    rewards = [Reward("exact_match_fn", 1.0, build_reward({"kind": "exact_match"}, "r").fn, {}),
               Reward("has_letter_fn", 1.0, has_letter_fn, {})]
    per_function = score(rewards, [b["prompt"] for b in batch], completions,
                         [r[m.bool()].tolist() for r, m in zip(out["completion_ids"], out["completion_mask"])],
                         {"answer": [b["answer"] for b in batch]}, G)
    ours_adv, zero_std = advantages_of(total(per_function, [1.0, 1.0]), G, scale)
    assert torch.allclose(ours_adv, out["advantages"], atol=1e-6), (ours_adv, out["advantages"])
    ours_metrics = metrics_of([r.name for r in rewards], per_function, [1.0, 1.0], zero_std)
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/exact_match_fn/mean",
                "rewards/has_letter_fn/mean", "rewards/has_letter_fn/std"):
        assert ours_metrics[key] == pytest.approx(metrics[key], abs=1e-6), key

    # the loss: old log-probabilities from the sampling policy, then the policy moved away from
    # it (ratios that clip, a KL to the reference that is not 0)
    step = GrpoStep(GrpoConfig(loss_type=loss_type, beta=beta, epsilon=0.1, epsilon_high=0.15,
                               temperature=1.3, max_completion_length=MAX_NEW, num_generations=G), rewards)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    initial = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)

    def forward(m):
        return lambda i, a, k: m(input_ids=i, attention_mask=a, logits_to_keep=k).logits
    with torch.no_grad():
        old = step.answer_logps(forward(initial), ids, mask, out["completion_ids"])
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours_model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
    ours_model.load_state_dict(trainer.model.state_dict())
    out["old_per_token_logps"] = old
    theirs = trainer._compute_loss(trainer.model, out)
    their_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    if beta:
        assert torch.allclose(old, out["ref_per_token_logps"], atol=1e-5)  # reference = initial model
    logps = step.answer_logps(forward(ours_model), ids, mask, out["completion_ids"])
    loss, sums = step.loss(logps, out["completion_mask"], out["advantages"], old_logps=old,
                           ref_logps=old if beta else None, gas=1,
                           step_tokens=float(out["num_items_in_batch"]), ranks=1)
    diff = abs(float(loss) - float(theirs))
    print(f"{loss_type}: ours {float(loss):.8f} trl {float(theirs):.8f} diff {diff:.2e}")
    assert diff <= 1e-5
    for key, (value, count) in sums.items():
        assert float(value / count) == pytest.approx(their_metrics[key], abs=1e-5), key
    assert their_metrics["clip_ratio/region_mean"] > 0  # clipping really happened
    if beta:
        assert their_metrics["kl"] > 1e-4  # the KL term really counted
    # and the gradients agree too
    loss.backward()
    theirs.backward()
    for (name, a), b in zip(ours_model.named_parameters(), trainer.model.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name


def _parity(tmp_path, nproc: int, cases: list[tuple[str, str]], *args: str) -> None:
    """Run the parity script once for every case (LOSS, SCALE) in one launch; each case's every
    step's loss and metrics agree with TRL's."""
    from conftest import save_tiny_llama
    from engine.data.default_task import make_examples, prompt_row
    from scripts.grpo_trl_parity import REWARDS
    save_tiny_llama(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(prompt_row(r)) + "\n"
                                                    for r in make_examples(32, seed=3)))
    (tmp_path / "parity_rewards.py").write_text(REWARDS)
    proc = run_deepspeed(SCRIPTS / "grpo_trl_parity.py", nproc=nproc, timeout=600,
                         args=("--work", str(tmp_path), "--iterations", "2", "--steps", "4", "--beta", "0.04",
                               "--cases", ",".join(f"{loss}:{scale}" for loss, scale in cases), *args))
    results = parse_results(proc)
    assert [(r["loss"], r["scale"]) for r in results] == cases
    for result in results:
        _check_case(json.loads(open(result["path"]).read()), (result["loss"], result["scale"]))


def _check_case(cell: dict, case: tuple[str, str]) -> None:
    ours, trl = cell["ours"], cell["trl"]
    assert len(ours) == len(trl) == 4 and cell["generations"] == 2, case
    worst = 0.0
    for step, (mine, theirs) in enumerate(zip(ours, trl)):
        shared = {k for k in theirs if k in mine}
        # TRL logs the rewards and lengths on the steps that sample (0 and 2), as we do
        assert ("reward" in mine) == ("reward" in theirs) == (step % 2 == 0), (case, step)
        assert {"loss", "kl", "clip_ratio/region_mean"} <= shared and set(mine) <= shared, (case, step, mine, theirs)
        for key in shared:
            assert mine[key] == pytest.approx(float(theirs[key]), abs=1e-5), (case, step, key, mine, theirs)
            worst = max(worst, abs(mine[key] - float(theirs[key])))
    assert ours[1]["clip_ratio/region_mean"] > 0 and ours[3]["kl"] > 1e-4, case  # reused samples: ratios clipped
    print(f"{case}: largest difference over {len(ours)} steps: {worst:.2e}")


def test_two_ranks_zero3_accumulation_and_reused_samples_match_trl(tmp_path):
    """2 ranks, ZeRO-3, 2 micro-batches a step, each loss type (dapo: normalized by the step's
    tokens on every rank; scale batch: the std of every rank's rewards), the four cases one after
    the other in one launch (one process start instead of four: each case builds its own TRL
    trainer and our Trainer from the same seed)."""
    _parity(tmp_path, 2, [("dapo", "group"), ("grpo", "batch"), ("dr_grpo", "none"), ("bnpo", "group")],
            "--zero", "3", "--accum", "2")


def test_one_rank_reused_samples_match_trl(tmp_path):
    """1 rank, num_iterations 2, bnpo (each micro-batch's token mean: the split into micro-batches counts)."""
    _parity(tmp_path, 1, [("bnpo", "group")], "--zero", "0", "--accum", "2")
