"""The step strategy of a GRPO run, chosen once at assembly (engine.assembly.root) in place of the
engine step when `preference.objective` is grpo (docs/rewards.md).

One optimizer step, its phases in order:

1. sample: each micro-batch's prompts, each repeated `num_generations` times, are completed
   with the live weights (engine.generation.generate: the run's layout does it, collectively
   under ZeRO-3 and tensor parallelism; batched, with the KV cache). The sampling seed is a
   function of the run's seed, the step, the micro-batch and the data-parallel rank, so an exact
   resume samples the same answers;
2. score: every reward function on this rank's samples (engine.objectives.rewards); a function
   that fails makes the whole step train nothing, on every rank, and the run pause with its
   message (function, prompt, exception; the traceback in the rank's log);
3. advantages: from the rewards of every rank's samples (one all-gather), TRL's way
   (engine.objectives.grpo.advantages_of);
4. train: per micro-batch, the policy's log-probabilities of the answers (and the reference's,
   beta > 0), the loss (engine.objectives.grpo.GrpoLoss), DeepSpeed's backward (the loss is
   already divided for the accumulation) and step.

`metrics` holds TRL's numbers of the step, which the step's train record carries
(engine.monitors.StepMetricsMonitor). The step is also a callback: after a failed scoring its
`on_train_batch_end` asks the loop to pause (to stop, where the run has no control plane)."""

from __future__ import annotations

import functools
import hashlib
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from contract.config.schema import GrpoConfig
from contract.events import WarningEvent
from contract.rewards import Reward
from engine.callbacks import NOTHING, Callback, Signal
from engine.generation.generate import end_ids, generate, pad_id
from engine.objectives.grpo import GrpoLoss, advantages_of, token_logps
from engine.objectives.losses import by_chunks, head_chunks, head_input, hf_model, keeps_logits, model_logits
from engine.objectives import grpo_chat
from engine.objectives.grpo_samples import Ratings
from engine.objectives.grpo_reuse import SampleBatch, gather_batches, reused
from engine.objectives.preference_step import mean_present, reduce_metrics
from engine.objectives.rewards import RewardError, metrics_of, score, total


@dataclass
class Samples:
    """One micro-batch's sampled answers: prompts (B*G, P) left-padded, answers (B*G, C) right-padded."""
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    texts: list[str]
    ids: list[list[int]]
    truncated: list[bool]
    indices: list[int]  # the dataset index of each sample's prompt


class GrpoStep(Callback):
    """One optimizer step of GRPO (see the module docstring)."""

    def __init__(self, config: GrpoConfig, rewards: list[Reward], reference: Any = None):
        self.config, self.rewards, self.reference = config, rewards, reference
        self.loss = GrpoLoss(config.loss_type, config.epsilon, config.epsilon_high, config.beta,
                             config.max_completion_length)
        self.metrics: dict[str, float] = {}
        self.failure: RewardError | None = None
        self.ratings = Ratings()  # the samples on screen and a person's ratings (grpo_samples)
        self.batch: SampleBatch | None = None  # the samples trained now (num_iterations steps)

    # -- the step -------------------------------------------------------------------------------
    def __call__(self, trainer, micro_batches: list[dict]) -> tuple[torch.Tensor, int]:
        self.metrics, self.failure = {}, None
        step, iterations = trainer.state.global_step, self.config.num_iterations
        if step % iterations == 0:  # sample, score, advantages; the next iterations reuse them
            self.batch = self._generation(trainer, micro_batches)
        else:
            self.batch = reused(self.batch, step - step % iterations, micro_batches)
        if self.batch.failed:  # a reward function failed (said once): the batch trains nothing
            return torch.zeros(()), 0
        batch, env = self.batch, trainer.env
        advantages, kept = torch.as_tensor(batch.advantages), batch.old_logps
        losses, sums, start, old_logps = [], [], 0, []
        for k, s in enumerate(batch.samples):
            count = s.completion_ids.size(0)
            loss, metric_sums, logps = self.train_micro_batch(
                trainer, s, advantages[start:start + count], gas=len(batch.samples),
                step_tokens=batch.step_tokens, old_logps=None if kept is None else kept[k])
            start += count
            old_logps.append(logps)
            losses.append(loss.detach().float())
            sums.append(reduce_metrics(metric_sums, env))
        if kept is None and iterations > 1:  # the sampling policy's: this step's weights, before its update
            batch.old_logps = old_logps
        self.metrics = {**(batch.metrics if step % iterations == 0 else {}), **mean_present(sums)}
        tokens = sum(int(s.prompt_mask.sum() + s.completion_mask.sum()) for s in batch.samples)
        return torch.stack(losses).sum(), tokens

    def _generation(self, trainer, micro_batches: list[dict]) -> SampleBatch:
        """Phases 1-3: this step's samples, their rewards and advantages (a failed batch when a
        reward function failed on any rank)."""
        env = trainer.env
        step = trainer.state.global_step
        samples = [self.sample(trainer, b, k) for k, b in enumerate(micro_batches)]
        per_function = self._score(trainer, samples)
        if per_function is None:
            return SampleBatch(step, failed=True)
        everyone = _gather(per_function, env)  # (ranks x N, F), rank by rank
        # a rated chat answer's group: its fresh samples drawn and scored now (grpo_chat)
        pending, self.failure = grpo_chat.complete_all(
            trainer, self.ratings.pending, self.config, self.rewards,
            lambda k: sample_seed(trainer.config.train.seed, step, -1 - k, 0), lambda f: _any_rank(f, env))
        if pending is None:
            return SampleBatch(step, failed=True)
        self.ratings.pending = pending
        names, weights = [r.name for r in self.rewards], [r.weight for r in self.rewards]
        # the groups rated since the last step join it, with a `human` reward (grpo_samples)
        rated = self.ratings.take(trainer, names, weights, everyone, self.config.num_generations)
        advantages, zero_std = advantages_of(total(rated.rewards, rated.weights),
                                             self.config.num_generations, self.config.scale_rewards)
        n = per_function.size(0)
        local = advantages[env.dp_rank * n:(env.dp_rank + 1) * n]
        lengths = torch.tensor([[len(x) for s in samples for x in s.ids],
                                [float(t) for s in samples for t in s.truncated]], dtype=torch.float32)
        lengths = _gather(lengths.T.contiguous(), env)
        metrics = {**metrics_of(rated.names, rated.rewards, rated.weights, zero_std),
                   "completions/mean_length": float(lengths[:, 0].mean()),
                   "completions/clipped_ratio": float(lengths[:, 1].mean())}
        self.ratings.keep(samples, everyone, advantages, names, weights, self.config.num_generations)
        samples, local = rated.join(samples, local, advantages, env, pad_id(trainer.tokenizer))
        return SampleBatch(step, samples=samples, advantages=local,
                           step_tokens=float(lengths[:, 0].sum()) + rated.tokens, metrics=metrics)

    # -- the samples of a batch reused over num_iterations steps: kept in checkpoints ---------------
    def on_save_checkpoint(self, trainer) -> Any:
        """Every data-parallel rank's buffered samples, when the run stands between the
        iterations of one batch (collective: every rank calls it); None otherwise."""
        if self.config.num_iterations == 1:
            return None
        if trainer.state.global_step % self.config.num_iterations == 0:
            return {"batches": None}  # the next step samples anew
        return {"batches": gather_batches(self.batch, trainer.env)}

    def on_load_checkpoint(self, trainer, state: Any) -> None:
        batches = state.get("batches") if isinstance(state, dict) else None
        self.batch = batches[trainer.env.dp_rank] if batches else None

    def sample(self, trainer, batch: dict, micro: int) -> Samples:
        """Phase 1: `num_generations` answers to each prompt of `batch` (collective)."""
        g, tok = self.config.num_generations, trainer.tokenizer
        prompts = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
        repeated = [p for p in prompts for _ in range(g)]
        captured: list[list[int]] = []
        texts = generate(trainer, repeated, max_new_tokens=self.config.max_completion_length,
                         temperature=self.config.temperature, top_p=self.config.top_p,
                         seed=sample_seed(trainer.config.train.seed, trainer.state.global_step, micro,
                                          trainer.env.dp_rank),
                         on_ids=captured.extend)
        ends, pad = end_ids(tok), pad_id(tok)
        ids = [row if row else [pad] for row in captured]
        truncated = [not row or row[-1] not in ends for row in captured]
        width_c = max(len(r) for r in ids)
        completion = torch.full((len(ids), width_c), pad, dtype=torch.long)
        cmask = torch.zeros_like(completion)
        for i, row in enumerate(ids):
            completion[i, :len(row)] = torch.tensor(row)
            cmask[i, :len(row)] = 1
        return Samples(batch["input_ids"].repeat_interleave(g, 0), batch["attention_mask"].repeat_interleave(g, 0),
                       completion, cmask, texts, ids, truncated,
                       [int(i) for i in batch["index"].repeat_interleave(g).tolist()])

    def _score(self, trainer, samples: list[Samples]) -> torch.Tensor | None:
        """Phase 2: (N, F) rewards of this rank's samples, or None (on every rank) when a reward
        function failed on any rank: the failure is kept for `on_train_batch_end`."""
        dataset = trainer.train_dataset
        failed = None
        parts = []
        for s in samples:
            prompts, columns = dataset.rows_of(s.indices)
            try:
                parts.append(score(self.rewards, prompts, s.texts, s.ids, columns, self.config.num_generations,
                                   rows=[dataset.rows[i] for i in s.indices[::self.config.num_generations]]))
            except RewardError as e:
                failed = e
                print(f"[rank {trainer.env.rank}] {e.message}\n{e.trace}", file=sys.stderr, flush=True)
                break
        if _any_rank(failed is not None, trainer.env):
            self.failure = failed or RewardError("?", 0, None, "a reward function failed on another rank "
                                                 "(its rank log has the traceback)")
            return None
        return torch.cat(parts)

    def train_micro_batch(self, trainer, s: Samples, advantages: torch.Tensor, *, gas: int,
                          step_tokens: float, old_logps: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """Phase 4 for one micro-batch: forward(s), loss, backward, step; also the answers'
        log-probabilities, detached (the sampling policy's on a batch's first iteration)."""
        engine = trainer.engine
        device = engine.device
        ids = torch.cat([s.prompt_ids, s.completion_ids], 1).to(device)
        mask = torch.cat([s.prompt_mask, s.completion_mask], 1).to(device)
        completion, cmask = s.completion_ids.to(device), s.completion_mask.to(device)
        logps = chunked_answer_logps(engine, ids, mask, completion, self.config.temperature,
                                     trainer.config.train.logits_chunk_rows)
        if logps is None:
            logps = self.answer_logps(lambda i, m, k: model_logits(engine, i, m, k), ids, mask, completion)
        ref = None
        if self.config.beta != 0.0:
            with torch.no_grad():
                ref = self.answer_logps(self.reference.logits, ids, mask, completion)
        loss, sums = self.loss(logps, cmask, advantages.to(device), ref_logps=ref, gas=gas,
                               old_logps=None if old_logps is None else old_logps.to(device),
                               step_tokens=step_tokens, ranks=trainer.env.dp_size)
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()
        return loss, sums, logps.detach().cpu()

    def answer_logps(self, forward, ids: torch.Tensor, mask: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
        """(B, C) log-probabilities of the answers' tokens: the logits of the C positions before
        each answer token (the forward keeps only the last C + 1 where the model can)."""
        c = completion.size(1)
        logits = forward(ids, mask, c + 1)
        return token_logps(logits[:, -(c + 1):-1], completion, self.config.temperature)

    # -- the callback: a failed scoring pauses the run -------------------------------------------
    def on_train_batch_end(self, trainer, loss: float) -> Signal | None:
        if self.failure is None:
            return NOTHING
        message = f"step {trainer.state.global_step} trained nothing: {self.failure.message}"
        trainer.emit(WarningEvent(step=trainer.state.global_step, message=message))
        if trainer.control is None:  # nobody could resume it: end the run instead
            return Signal(stop=True, reason=message)
        return Signal(pause=True, reason=message)


def _chunk_logps(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    return token_logps(head(hidden), targets, temperature)


def chunked_answer_logps(model, ids: torch.Tensor, mask: torch.Tensor, completion: torch.Tensor,
                         temperature: float, rows: int) -> torch.Tensor | None:
    """(B, C) log-probabilities of the answers' tokens with the output head run `rows` positions
    at a time (`train.logits_chunk_rows`, as SFT's cross-entropy: engine.objectives.losses), each
    chunk's logits recomputed in the backward, so one chunk's (rows, vocab) logits exist at once
    instead of the micro-batch's (B, C, vocab) and their log-softmax. None where it does not
    apply (few enough positions, `rows` 0, a model that keeps no logits or changes them after
    its head): the caller computes them at once. `model`: the engine or the module; the decision
    is the same on every rank (ZeRO-3's ranks agree on the number of head calls)."""
    if not keeps_logits(hf_model(model)):
        return None
    chunks = head_chunks(model, completion.numel(), rows)
    if chunks <= 1:
        return None
    hidden, head = head_input(model, {"input_ids": ids, "attention_mask": mask}, completion.size(1) + 1, model)
    hidden = hidden[:, :-1].reshape(-1, hidden.size(-1))  # the positions before each answer token
    parts = by_chunks(functools.partial(_chunk_logps, temperature=temperature), head, hidden,
                      completion.reshape(-1), rows, chunks)
    return torch.cat(parts).view(completion.shape)


def sample_seed(seed: int, step: int, micro: int, dp_rank: int) -> int:
    """The sampling seed of a micro-batch: the same for the same run seed, step and rank (an exact
    resume repeats the samples; tensor-parallel peers share a data-parallel rank, so they agree)."""
    digest = hashlib.sha256(f"grpo/{seed}/{step}/{micro}/{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _gather(values: torch.Tensor, env) -> torch.Tensor:
    """Every data-parallel rank's `values` (the same shape on each), rank by rank."""
    if env.dp_size == 1:
        return values
    local = values.to(env.device)
    parts = [torch.empty_like(local) for _ in range(env.dp_size)]
    dist.all_gather(parts, local, group=env.dp_group)
    return torch.cat(parts).cpu()


def _any_rank(flag: bool, env) -> bool:
    """Whether `flag` is set on any rank (every rank, tensor-parallel peers included, answers alike)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    value = torch.tensor([int(flag)], device=env.device)
    dist.all_reduce(value)
    return bool(value.item())
