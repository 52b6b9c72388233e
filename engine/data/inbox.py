"""The inbox as a training source: taught (prompt, answer) pairs and preferences (prompt, better,
worse answer), tokenized as the model saw them.

The prompt is the very text generation continued (its chat template and BOS included), so it is
tokenized without adding special tokens; the answer follows, then EOS. The loss is on the answer
and EOS only, like the input_output format. The file is contract.inbox's; this dataset holds
what the run has taken of it (entries taught since, in another timeline after a resume, are not
in it). Forgotten entries stay at their index, so the mixture's keys stay valid, but are never
drawn again.

A preference becomes the samples its run's objective trains on (`pairs_as`, from
`pairs_as_for(objective)`, kept in the dataset's state so a resume encodes alike):

* "pairs" (dpo, orpo, simpo): one pair sample {prompt_ids, chosen_ids, rejected_ids};
* "sft": one token sample of the chosen answer (trained as a taught answer) that carries the
  pair under `LIVE_PAIR`; the collator puts the pairs of a micro-batch beside its rows, under
  the `PAIR_PREFIX` keys, and the SFT step adds a preference term for them (engine.objectives.preference_step);
* "unpaired" (kto): two judged samples, the chosen answer desirable and the rejected one not
  (TRL's `unpair_preference_dataset`).
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from contract.inbox import InboxError, read_inbox
from contract.data_rows import IGNORE

LIVE_PAIR = "pair"       # a token sample's preference pair (an SFT run's live pair)
PAIR_PREFIX = "pair_"    # a collated batch's pair rows: pair_input_ids, pair_attention_mask, pair_labels
PAIRS_AS = ("pairs", "sft", "unpaired")


def pairs_as_for(objective: str) -> str:
    """How a run of `objective` trains a preference from the inbox (see the module docstring)."""
    return {"sft": "sft", "kto": "unpaired"}.get(objective, "pairs")


def encode_pair(tokenizer, prompt: str, answer: str, max_length: int, rejected: str | None = None) -> dict:
    """One training sample of a taught pair, or InboxError naming the field too long. With
    `rejected`, a preference sample (engine.data.preference's pair: prompt, chosen, rejected)."""
    prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    answers = {"answer": answer} if rejected is None else {"answer": answer, "rejected": rejected}
    ids = {}
    for name, text in answers.items():
        ids[name] = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + eos
        if len(ids[name]) > max_length:
            raise InboxError(f"teach: `{name}` is {len(ids[name])} tokens (with EOS), longer than "
                             f"data.max_length={max_length}")
        if len(prompt_ids) + len(ids[name]) > max_length:
            raise InboxError(f"teach: `prompt` ({len(prompt_ids)} tokens) and `{name}` ({len(ids[name])} tokens "
                             f"with EOS) together are {len(prompt_ids) + len(ids[name])} tokens, longer than "
                             f"data.max_length={max_length}; shorten either, or raise data.max_length")
    if rejected is not None:
        return {"prompt_ids": prompt_ids, "chosen_ids": ids["answer"], "rejected_ids": ids["rejected"]}
    return {"input_ids": prompt_ids + ids["answer"], "labels": [IGNORE] * len(prompt_ids) + ids["answer"]}


def samples_of_pair(pair: dict, pairs_as: str) -> list[dict]:
    """The training samples of an encoded preference for a run that trains it `pairs_as`."""
    prompt, chosen = pair["prompt_ids"], pair["chosen_ids"]
    if pairs_as == "sft":
        return [{"input_ids": prompt + chosen, "labels": [IGNORE] * len(prompt) + chosen, LIVE_PAIR: pair}]
    if pairs_as == "unpaired":
        return [{"prompt_ids": prompt, "completion_ids": chosen, "label": True},
                {"prompt_ids": prompt, "completion_ids": pair["rejected_ids"], "label": False}]
    return [pair]


def _length(sample: dict) -> int:
    if "input_ids" in sample:
        return len(sample["input_ids"])
    answers = [sample[k] for k in ("chosen_ids", "rejected_ids", "completion_ids") if k in sample]
    return len(sample["prompt_ids"]) + max(len(a) for a in answers)


class InboxDataset(Dataset):
    """The taught samples of a run, in the order taught; an entry has one sample, a KTO run's
    preference two (`entry_of` maps a sample to its entry)."""

    def __init__(self, tokenizer, max_length: int, path: str | Path, pairs_as: str = "pairs"):
        if pairs_as not in PAIRS_AS:
            raise ValueError(f"pairs_as must be one of {PAIRS_AS}, not {pairs_as!r}")
        self.tokenizer, self.max_length, self.path = tokenizer, max_length, Path(path)
        self.pairs_as = pairs_as
        self.ids: list[str] = []                 # per entry
        self.pairs: list[tuple[str, str]] = []   # per entry: (prompt, answer)
        self.rejected: list[str | None] = []     # per entry: a preference's worse answer, else None
        self.samples: list[dict] = []            # per sample
        self.entry_of: list[int] = []            # per sample: its entry's index
        self.forgotten: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]

    @property
    def lengths(self) -> list[int]:
        return [_length(s) for s in self.samples]

    def add(self, entry_id: str, prompt: str, answer: str, rejected: str | None = None) -> list[int]:
        """Take a taught pair or preference (already checked with encode_pair); its samples' indices."""
        encoded = encode_pair(self.tokenizer, prompt, answer, self.max_length, rejected)
        new = samples_of_pair(encoded, self.pairs_as) if rejected is not None else [encoded]
        first = len(self.samples)
        self.samples += new
        self.entry_of += [len(self.ids)] * len(new)
        self.ids.append(entry_id)
        self.pairs.append((prompt, answer))
        self.rejected.append(rejected)
        return list(range(first, len(self.samples)))

    def has_pairs(self) -> bool:
        """Whether any entry (forgotten ones included) is a preference."""
        return any(r is not None for r in self.rejected)

    def index_of(self, entry_id: str) -> int:
        if entry_id not in self.ids:
            raise InboxError(f"forget: no inbox entry {entry_id!r}; the entries are "
                             f"{', '.join(self.ids) or 'none'}")
        return self.ids.index(entry_id)

    def forget(self, entry_id: str) -> None:
        self.index_of(entry_id)
        self.forgotten.add(entry_id)

    def active(self) -> list[int]:
        """Indices of the samples whose entry is not forgotten."""
        return [i for i, e in enumerate(self.entry_of) if self.ids[e] not in self.forgotten]

    def state_dict(self) -> dict:
        return {"ids": list(self.ids), "forgotten": sorted(self.forgotten), "pairs_as": self.pairs_as}

    def load_state_dict(self, state: dict) -> None:
        """Hold exactly the entries the checkpoint's run had, read back from the inbox file."""
        known = {e.id: e for e in read_inbox(self.path)}
        missing = [i for i in state["ids"] if i not in known]
        if missing:
            raise InboxError(f"{self.path} lacks the entries {', '.join(missing)} the checkpoint trained on")
        self.pairs_as = state.get("pairs_as", "pairs")  # a checkpoint from before: pairs stay pairs
        self.ids, self.pairs, self.samples, self.rejected, self.entry_of = [], [], [], [], []
        for entry_id in state["ids"]:
            self.add(entry_id, known[entry_id].prompt, known[entry_id].answer, known[entry_id].rejected)
        self.forgotten = set(state.get("forgotten", []))
