"""Rating an answer the chat gave during a GRPO run (docs/rewards.md, "Rating a chat answer").

A chat answer has no group, and GRPO's advantage is relative to its group: a rated answer alone
trains nothing. So a rating of a chat answer makes one: at the next step the engine samples
grpo.num_generations - 1 fresh answers to the same prompt with the live weights and trains them
with the rated answer as one more group of that step, as a rated sample's group is
(engine.objectives.grpo_samples).

* While a GRPO run chats (`generate`), every rank keeps the live weights' last `CHAT_KEPT`
  answers: the prompt as the model saw it, its ids, the answer's text and its ids, and the step.
  Only those can be rated: an answer of the base model (compare_base), of a checkpoint's or
  another run's copy, from before a resume or a rewind, is not among them and is refused.
* `rate_chat` (contract.protocol.rating_commands.RateChat) names one by its prompt (or chat) and
  text, and optionally its step. Rank 0 appends the rating to the inbox (the prompt's ids and the
  answer's ids as the chat produced them, the score), fsynced before the answer; every rank holds
  it as pending (a `Rating` with `chat` set).
* At the next step (`complete_all`): the fresh samples are drawn with the step's GRPO settings and a
  seed from the run's seed, the step and the rating's place among the step's chat ratings
  (grpo_step.sample_seed with a negative micro-batch number), so an exact resume draws them again.
  Every reward function scores the whole group with the chat's prompt; the data's columns are
  None for it (a chat prompt has no answer column: exact match and numeric say None, as for a
  row that lacks the column). The `human` reward is the score for the rated answer and 0 for the
  fresh ones: "not rated" is the neutral middle of the [-1, 1] scale, so the group's advantage
  says whether the rated answer was better or worse than what the model gives now, plus what the
  functions that could score say. (With None for the fresh answers, a group no function can score
  would have one scored sample, no std, and advantage 0 everywhere: nothing would train.) Every
  rank draws and scores the same group; rank 0's rewards are used by all.
* The rated answer was drawn with the chat's settings (any temperature, greedy too), not the
  step's: it is off-policy. GRPO's ratio is taken against the step's own log-probabilities (1 on
  a batch's first iteration), as TRL does for its samples, so its gradient is advantage x the
  gradient of its log-probability: up raises its likelihood against the fresh answers', down
  lowers it.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from contract.protocol.rating_commands import RateChat
from engine.generation.generate import generate, pad_id
from engine.objectives.rewards import RewardError, score

CHAT_KEPT = 32  # the live weights' latest chat answers a rating may name


@dataclass(frozen=True)
class ChatAnswer:
    """One answer the chat gave with the live weights (what rating it needs)."""
    step: int
    prompt: str             # the text the model continued (the chat template applied)
    prompt_ids: list[int]
    text: str               # as generate answered it
    ids: list[int]          # its token ids, as generated (the end token kept)
    chat_prompt: Any        # the prompt or messages as sent (what the reward functions get)


class ChatAnswers:
    """The live weights' last CHAT_KEPT chat answers (the same on every rank)."""

    def __init__(self) -> None:
        self.answers: deque[ChatAnswer] = deque(maxlen=CHAT_KEPT)

    def keep(self, answer: ChatAnswer) -> None:
        self.answers.append(answer)

    def clear(self) -> None:
        self.answers.clear()

    def find(self, prompt: str, text: str, step: int | None) -> ChatAnswer | None:
        """The latest kept answer with this prompt and text (and step, when given)."""
        for a in reversed(self.answers):
            if a.prompt == prompt and a.text == text and (step is None or a.step == step):
                return a
        return None


def keep_answer(ratings: Any, trainer: Any, step: int, prompt: str, chat_prompt: Any, text: str,
                ids: list[int]) -> None:
    """Keep a chat answer of the live weights for `rate_chat` (a GRPO run's `generate`)."""
    prompt_ids = list(trainer.tokenizer(prompt, add_special_tokens=False)["input_ids"])  # as generate encoded it
    ratings.chat.keep(ChatAnswer(step, prompt, prompt_ids, text, list(ids), chat_prompt))


def rate(ratings: Any, trainer: Any, cmd: RateChat, prompt: str, rank: int,
         from_rank0: Callable[[Any], Any], refused: type[Exception]) -> dict:
    """Write the rating of a kept chat answer to the inbox (rank 0, fsynced), then hold it as
    pending (every rank); `refused` is raised, alike on every rank, when it cannot apply."""
    answer = ratings.chat.find(prompt, cmd.answer, cmd.step)
    if answer is None:
        at = f" at step {cmd.step}" if cmd.step is not None else ""
        raise refused(f"rate_chat: this run's live weights gave no such answer to that prompt{at} among their last "
                      f"{CHAT_KEPT} chat answers (an answer of the base model, of a checkpoint's or another run's "
                      "copy, or from before a resume or a rewind cannot be rated); send the prompt or messages "
                      "and the answer's text exactly as generate took and gave them")
    if not answer.ids:
        raise refused("rate_chat: the answer is empty (no token was generated): there is nothing to rate")
    record = {"chat": True, "answer_step": answer.step, "score": cmd.score, "rated": 0, "prompt": answer.prompt,
              "completion": answer.text, "chat_prompt": answer.chat_prompt, "prompt_ids": answer.prompt_ids,
              "completion_ids": [answer.ids], "rewards": {}}
    step = trainer.state.global_step
    entry_id = ratings.add(trainer, record, rank, from_rank0, "rate_chat", refused)
    return {"step": step, "id": entry_id, "answer_step": answer.step, "score": cmd.score,
            "group_size": trainer.train_fn.config.num_generations, "applies_from_step": step + 1}


def complete_all(trainer: Any, pending: list, config: Any, rewards: list, seed_of: Callable[[int], int],
                 agree: Callable[[bool], bool]) -> tuple[list | None, RewardError | None]:
    """`pending` with each chat rating's group completed (`draw`, then `score_group`, rank 0's
    scores on every rank; the `human` reward 0 for the fresh answers: Rating.grouped), or (None,
    the error) when a reward function failed on any rank (every rank alike: `agree` is true on
    all when on any). The k-th chat rating's fresh answers are drawn with seed `seed_of(k)`."""
    chats = [r for r in pending if r.chat and r.unrated is None]
    done: dict[str, Any] = {}
    for k, rating in enumerate(chats):
        ids, completions = draw(trainer, rating, config, seed_of(k))
        failed = None
        try:
            values = score_group(trainer, rating, rewards, ids, completions)
        except RewardError as e:
            failed = e
            print(f"[rank {trainer.env.rank}] {e.message}\n{e.trace}", file=sys.stderr, flush=True)
        if agree(failed is not None):
            return None, failed or RewardError("?", 0, None, "a reward function failed on another rank "
                                               "(its rank log has the traceback)")
        values = _rank0s(values, trainer.env)
        done[rating.id] = rating.grouped(ids, {r.name: [None if v != v else float(v) for v in values[:, j].tolist()]
                                               for j, r in enumerate(rewards)})
    return [done.get(r.id, r) for r in pending], None


def draw(trainer: Any, rating: Any, config: Any, seed: int) -> tuple[list[list[int]], list[str]]:
    """The group's answers: the rated one, then num_generations - 1 fresh samples of its prompt
    with the live weights (collective: every rank draws the same, with `seed`)."""
    g, tok = config.num_generations, trainer.tokenizer
    captured: list[list[int]] = []
    texts = generate(trainer, [rating.prompt_ids] * (g - 1), max_new_tokens=config.max_completion_length,
                     temperature=config.temperature, top_p=config.top_p, seed=seed, on_ids=captured.extend)
    return [rating.completion_ids[0], *(row if row else [pad_id(tok)] for row in captured)], \
        [rating.completion_text, *texts]


def score_group(trainer: Any, rating: Any, rewards: list, ids: list[list[int]], completions: list[str]) -> torch.Tensor:
    """(G, F) rewards of the group: the chat's prompt, every data column None."""
    g = len(ids)
    names = dict.fromkeys(k for row in trainer.train_dataset.columns for k in row)
    prompt = rating.chat_prompt if rating.chat_prompt is not None else rating.prompt
    return score(rewards, [prompt] * g, completions, ids, {name: [None] * g for name in names}, g)


def _rank0s(values: torch.Tensor, env: Any) -> torch.Tensor:
    """Rank 0's `values` on every rank (a reward function need not answer alike on each)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    out = values.to(env.device)
    dist.broadcast(out, src=0)
    return out.cpu()
