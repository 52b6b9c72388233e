"""A GRPO run's samples on screen and a person's ratings of them (docs/rewards.md, "Samples and
ratings").

* After each step, rank 0 writes a `samples` event (contract.events.SamplesEvent): every rank's
  sampled answers (one all-gather of their token ids and texts over the data-parallel group),
  each with its number in the step, group, data row, prompt (without special tokens), completion,
  each reward function's score, the weighted total, the advantage and whether it was clipped. To
  keep events.jsonl small an event holds the first `EVENT_SAMPLES` samples (whole groups) and cuts
  each text to `TEXT_LIMIT` characters. Every rank keeps the last `KEPT_STEPS` steps' samples (token
  ids and rewards), the ones a rating may name.
* `rate` (contract.protocol.rating_commands.Rate) names a kept sample. Rank 0 appends the rating to
  the run's inbox (contract.inbox.add_rating: the prompt's and the group's completions' ids, their
  function rewards, the rated sample and its score), fsynced before the answer; every rank then
  holds it as pending. The next step trains the rated group once more, as one more group of that
  step, with a `human` reward (weight 1): the rated answer gets the score, the others None, and
  TRL's NaN-aware total and advantages (engine.objectives.rewards.total, grpo.advantages_of) do the
  rest. The group's function rewards are its own, read by name under the run's present weights (a
  function added since scores it None). The group joins the first data-parallel rank's last
  micro-batch (DeepSpeed's accumulation keeps its count of micro-batches); its answer tokens count
  in the step's (dapo). `rewards/human/mean` is then in the step's metrics.
* `rate_chat` rates an answer the chat gave: engine.objectives.grpo_chat keeps the chat's answers
  and completes such a rating's group with fresh samples at the next step (`Rating.chat`).
* `forget` of a rating's id drops it if it has not trained yet (and from every later replay).
* A rating given at step S's boundary is in the inbox with step S: a resume or rewind to step S's
  checkpoint (which was written before that boundary's commands) replays it at step S + 1, as the
  uninterrupted run trained it; the samples it rates were the same there (seeded sampling).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from contract import inbox as inbox_file
from contract.events import DataEvent, SampleRow, SamplesEvent, WarningEvent
from contract.protocol.data_commands import Forget
from contract.protocol.rating_commands import Rate
from engine.callbacks import NOTHING, Callback, Signal
from engine.generation.generate import pad_ids
from engine.objectives.grpo_chat import ChatAnswers
from engine.objectives.rewards import total

TEXT_LIMIT = 300     # characters of each prompt and completion in a samples event
EVENT_SAMPLES = 64   # samples in one event at most (the step's first, whole groups)
KEPT_STEPS = 8       # the latest steps whose samples a rating may name
HUMAN = "human"      # the reward a rating gives (its metric: rewards/human/mean)
HUMAN_WEIGHT = 1.0


class RatingRefused(RuntimeError):
    """A rate or forget that cannot apply (alike on every rank); nothing changed."""


@dataclass
class Kept:
    """One sampled answer of a kept step: what a rating of it (or of its group) needs."""
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    clipped: bool
    index: int  # the prompt's dataset index


@dataclass
class KeptStep:
    """A step's samples (every rank's, rank by rank), their function rewards and group size."""
    samples: list[Kept]
    names: list[str]
    rewards: list[list[float | None]]  # per sample, per function
    num_generations: int


@dataclass
class Rating:
    """A pending rating: its group, as the inbox holds it. A chat answer's rating (`chat`) holds
    the rated answer only until the step that trains it completes its group (grpo_chat), whose
    unrated answers then get `unrated` as their `human` reward (None: a rated sample's group,
    whose other answers the `human` reward does not score)."""
    id: str
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    rewards: dict[str, list[float | None]]
    rated: int
    score: float
    chat: bool = False
    prompt: str = ""                # the prompt's text (a chat rating's reward functions get it,
    chat_prompt: Any = None         # or the prompt / messages as sent to generate)
    completion_text: str = ""       # the rated answer's text
    unrated: float | None = None

    @classmethod
    def of(cls, record: dict) -> "Rating":
        return cls(record["id"], list(record["prompt_ids"]), [list(c) for c in record["completion_ids"]],
                   dict(record["rewards"]), int(record["rated"]), float(record["score"]),
                   chat=bool(record.get("chat", False)), prompt=str(record.get("prompt", "")),
                   chat_prompt=record.get("chat_prompt"), completion_text=str(record.get("completion", "")))

    def grouped(self, completion_ids: list[list[int]], rewards: dict[str, list[float | None]]) -> "Rating":
        """A chat rating with its whole group: the rated answer first, the fresh ones `human` 0."""
        return replace(self, completion_ids=completion_ids, rewards=rewards, rated=0, unrated=0.0)

    def rows(self, names: Sequence[str]) -> torch.Tensor:
        """(G, F + 1): the group's function rewards under `names` (NaN: not scored), then `human`."""
        g = len(self.completion_ids)
        out = torch.full((g, len(names) + 1), float("nan"), dtype=torch.float32)
        for j, name in enumerate(names):
            for i, value in enumerate(self.rewards.get(name, [None] * g)):
                if value is not None:
                    out[i, j] = float(value)
        if self.unrated is not None:
            out[:, -1] = self.unrated
        out[self.rated, -1] = self.score
        return out


@dataclass
class Rated:
    """A step's rewards with its rated groups appended (`names`, `weights` gain `human` when there
    are any); what the step's advantages and metrics are computed from."""
    names: list[str]
    weights: list[float]
    rewards: torch.Tensor
    groups: list[Rating] = field(default_factory=list)

    @property
    def tokens(self) -> float:
        """The rated groups' answer tokens (trained on one rank: counted once in the step's)."""
        return float(sum(len(c) for g in self.groups for c in g.completion_ids))

    def join(self, samples: list, local: torch.Tensor, advantages: torch.Tensor, env, pad: int
             ) -> tuple[list, torch.Tensor]:
        """(micro-batches, this rank's advantages) with the rated groups added to the first
        data-parallel rank's last micro-batch (their advantages are the step's last rows)."""
        if not self.groups or env.dp_rank != 0:
            return samples, local
        extra = sum(len(g.completion_ids) for g in self.groups)
        last = samples[-1]
        prompts = [row[m.bool()].tolist() for row, m in zip(last.prompt_ids, last.prompt_mask)]
        answers = list(last.ids)
        for g in self.groups:
            prompts += [g.prompt_ids] * len(g.completion_ids)
            answers += g.completion_ids
        p, c = pad_ids(prompts, pad, "cpu", left=True), pad_ids(answers, pad, "cpu", left=False)
        joined = replace(last, prompt_ids=p["input_ids"], prompt_mask=p["attention_mask"],
                         completion_ids=c["input_ids"], completion_mask=c["attention_mask"],
                         texts=list(last.texts) + [""] * extra, ids=answers,
                         truncated=list(last.truncated) + [False] * extra, indices=list(last.indices) + [-1] * extra)
        return [*samples[:-1], joined], torch.cat([local, advantages[-extra:]])


class Ratings(Callback):
    """The samples kept for rating, the pending ratings, and the `samples` event (see the module
    docstring). A callback of the run (engine.assembly.root): it publishes after each step and
    keeps the step of its checkpoints, by which a resume replays the ratings."""

    def __init__(self) -> None:
        self.pending: list[Rating] = []
        self.kept: dict[int, KeptStep] = {}
        self.chat = ChatAnswers()  # the live weights' last chat answers (grpo_chat)
        self.step_samples: tuple | None = None  # (micro-batches, rewards, advantages, names, weights, G)

    @property
    def state_key(self) -> str:
        return "GrpoRatings"

    @staticmethod
    def rating_of(record: dict) -> Rating:
        return Rating.of(record)

    # -- the step: the pending ratings as more groups ----------------------------------------------
    def take(self, trainer, names: list[str], weights: list[float], everyone: torch.Tensor,
             num_generations: int) -> Rated:
        """The step's rewards with the pending ratings' groups (which are then no longer pending)."""
        groups, self.pending = self.pending, []
        fits = [g for g in groups if len(g.completion_ids) == num_generations]
        if len(fits) < len(groups):  # num_generations changed since: that group cannot join this step
            trainer.emit(WarningEvent(step=trainer.state.global_step, message=(
                f"ratings {', '.join(g.id for g in groups if g not in fits)} not trained: their groups have "
                f"another size than grpo.num_generations={num_generations}")))
        if not fits:
            return Rated(list(names), list(weights), everyone)
        widened = torch.cat([everyone, torch.full((everyone.size(0), 1), float("nan"))], dim=1)
        rows = torch.cat([widened, *(g.rows(names) for g in fits)])
        return Rated([*names, HUMAN], [*weights, HUMAN_WEIGHT], rows, fits)

    def keep(self, samples: list, everyone: torch.Tensor, advantages: torch.Tensor, names: list[str],
             weights: list[float], num_generations: int) -> None:
        """What the step sampled (this rank's micro-batches) and every rank's rewards and
        advantages, published after the step (on_train_batch_end)."""
        self.step_samples = (samples, everyone, advantages[:everyone.size(0)], list(names), list(weights),
                             num_generations)

    # -- the callback ----------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, loss: float) -> Signal | None:
        if self.step_samples is not None:
            self.publish(trainer, *self.step_samples)
            self.step_samples = None
        return NOTHING

    def publish(self, trainer, samples: list, everyone: torch.Tensor, advantages: torch.Tensor,
                names: list[str], weights: list[float], g: int) -> None:
        """Keep the step's samples (every rank's: collective) and write its `samples` event (rank 0)."""
        env, step = trainer.env, trainer.state.global_step
        mine = [Kept(row[m.bool()].tolist(), ids, text, clipped, index)
                for s in samples for row, m, ids, text, clipped, index
                in zip(s.prompt_ids, s.prompt_mask, s.ids, s.texts, s.truncated, s.indices)]
        kept = _all_samples(mine, env)
        values = [[None if v != v else float(v) for v in row] for row in everyone.tolist()]  # NaN: None
        self.kept[step] = KeptStep(kept, list(names), values, g)
        for old in sorted(self.kept)[:-KEPT_STEPS]:
            del self.kept[old]
        if env.rank != 0:
            return
        totals = total(everyone, weights).tolist()
        shown = min(len(kept), max(g, EVENT_SAMPLES - EVENT_SAMPLES % g))
        rows = trainer.train_dataset.rows
        table = [SampleRow(number=i, group=i // g, row=rows[k.index] if 0 <= k.index < len(rows) else None,
                           prompt=_cut(trainer.tokenizer.decode(k.prompt_ids, skip_special_tokens=True)),
                           completion=_cut(k.text), rewards=dict(zip(names, values[i])),
                           total=None if totals[i] != totals[i] else totals[i],
                           advantage=float(advantages[i]), clipped=k.clipped)
                 for i, k in enumerate(kept[:shown])]
        trainer.emit(SamplesEvent(step=step, samples=table, count=len(kept), text_limit=TEXT_LIMIT))

    def on_save_checkpoint(self, trainer) -> Any:
        return {"step": trainer.state.global_step, "inbox": str(_inbox(trainer)),
                "iterations": trainer.config.grpo.num_iterations}

    def on_load_checkpoint(self, trainer, state: Any) -> None:
        """Replay: the ratings still pending at the checkpoint's step and not forgotten then
        (read from the checkpoint's run's inbox: a resume into another folder replays them too)."""
        step = int(state["step"])
        self.kept, self.step_samples = {}, None
        self.chat.clear()  # answers of the weights before the load: no longer the live weights'
        path = Path(state.get("inbox") or _inbox(trainer))
        self.pending = [Rating.of(r) for r in inbox_file.read_ratings(path)
                        if _pending_at(int(r.get("step", -1)), step, int(state.get("iterations", 1)))
                        and (r["forgotten_at"] is None or r["forgotten_at"] > step)]

    # -- the commands (engine.control.handlers) -------------------------------------------------------
    def add(self, trainer, record: dict, rank: int, from_rank0: Callable[[Any], Any], verb: str,
            refused: type[Exception]) -> str:
        """Append a rating `record` to the inbox on rank 0 (durable before anything changes in
        memory, and before the answer), agree on its id, and hold it pending on every rank."""
        entry_id, error = None, None
        if rank == 0:
            path = _inbox(trainer)
            try:
                entry_id = inbox_file.next_id(path)
                inbox_file.add_rating(path, entry_id, trainer.state.global_step, record)
            except OSError as e:
                error = f"{verb}: the inbox {path} could not be written: {e}"
        entry_id, error = from_rank0((entry_id, error))
        if error:
            raise refused(error)
        self.pending.append(Rating.of({**record, "id": entry_id}))
        return entry_id

    def rate(self, trainer, cmd: Rate, rank: int, from_rank0: Callable[[Any], Any]) -> dict:
        """Write the rating to the inbox (rank 0, fsynced), then hold it as pending (every rank)."""
        kept = self.kept.get(cmd.step)
        if kept is None:
            held = ", ".join(map(str, sorted(self.kept))) or "none yet"
            raise RatingRefused(f"rate: the samples of step {cmd.step} are not held (the last {KEPT_STEPS} "
                                f"steps' are: {held})")
        if cmd.sample >= len(kept.samples):
            raise RatingRefused(f"rate: step {cmd.step} has samples 0 to {len(kept.samples) - 1}, not {cmd.sample}")
        g = kept.num_generations
        group = cmd.sample // g
        members = range(group * g, group * g + g)
        record = {"sample_step": cmd.step, "sample": cmd.sample, "score": cmd.score, "rated": cmd.sample % g,
                  "prompt": trainer.tokenizer.decode(kept.samples[cmd.sample].prompt_ids, skip_special_tokens=True),
                  "completion": kept.samples[cmd.sample].text,
                  "prompt_ids": kept.samples[cmd.sample].prompt_ids,
                  "completion_ids": [kept.samples[i].completion_ids for i in members],
                  "rewards": {n: [kept.rewards[i][j] for i in members] for j, n in enumerate(kept.names)}}
        step = trainer.state.global_step
        entry_id = self.add(trainer, record, rank, from_rank0, "rate", RatingRefused)
        return {"step": step, "id": entry_id, "sample_step": cmd.step, "sample": cmd.sample, "group": group,
                "score": cmd.score, "applies_from_step": step + 1}

    def forget(self, trainer, cmd: Forget, rank: int, from_rank0: Callable[[Any], Any]) -> dict | None:
        """Forget a rating (None when `cmd.id` names no rating: another entry of the inbox)."""
        path = _inbox(trainer)
        found = next((r for r in inbox_file.read_ratings(path) if r["id"] == cmd.id), None)
        if found is None:
            return None
        if found["forgotten_at"] is not None:
            raise RatingRefused(f"forget: rating {cmd.id!r} is forgotten already")
        step, error = trainer.state.global_step, None
        if rank == 0:
            try:
                inbox_file.forget_entry(path, cmd.id, step)
            except OSError as e:
                error = f"forget: the inbox {path} could not be written: {e}"
        error = from_rank0(error)
        if error:
            raise RatingRefused(error)
        self.pending = [r for r in self.pending if r.id != cmd.id]
        source = {"name": "ratings", "kind": "rating", "pending": len(self.pending)}
        trainer.emit(DataEvent(step=step, change="forget", id=cmd.id, source=source, sources=[],
                               applies_from_step=step + 1))
        return {"step": step, "id": cmd.id, "source": source, "sources": [], "applies_from_step": step + 1}


def ratings_of(trainer) -> Ratings | None:
    """The run's ratings (a GRPO run's step holds them), or None."""
    ratings = getattr(getattr(trainer, "train_fn", None), "ratings", None)
    return ratings if isinstance(ratings, Ratings) else None


def _pending_at(given: int, step: int, iterations: int) -> bool:
    """Whether a rating given at step `given`'s boundary is still pending when `step` steps are
    done: a step samples (and takes the pending ratings) when the steps done before it are a
    multiple of grpo.num_iterations; the steps between reuse the samples, so a rating given
    after a step that samples waits for the next one that does."""
    last_sampled = step - (step % iterations or iterations)  # steps done before the last sampling step
    return last_sampled < given <= step


def _inbox(trainer) -> Path:
    return inbox_file.inbox_path(trainer.folder.root)


def _cut(text: str) -> str:
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT - 1] + "…"


def _all_samples(mine: list[Kept], env) -> list[Kept]:
    """Every data-parallel rank's samples, rank by rank (the order of the step's rewards)."""
    if env.dp_size == 1:
        return mine
    everyone: list[Any] = [None] * env.dp_size
    dist.all_gather_object(everyone, mine, group=env.dp_group)
    return [k for part in everyone for k in part]
