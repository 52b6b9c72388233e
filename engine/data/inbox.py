"""The inbox as a training source: taught (prompt, answer) pairs, tokenized as the model saw them.

The prompt is the very text generation continued (its chat template and BOS included), so it is
tokenized without adding special tokens; the answer follows, then EOS. The loss is on the answer
and EOS only, like the input_output format. The file is contract.inbox's; this dataset holds
what the run has taken of it (entries taught since, in another timeline after a resume, are not
in it). Forgotten entries stay at their index, so the mixture's keys stay valid, but are never
drawn again.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from contract.inbox import InboxError, read_inbox
from contract.data_rows import IGNORE


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
            raise InboxError(f"teach: `prompt` and `{name}` together are {len(prompt_ids) + len(ids[name])} "
                             f"tokens, longer than data.max_length={max_length}; shorten the prompt")
    if rejected is not None:
        return {"prompt_ids": prompt_ids, "chosen_ids": ids["answer"], "rejected_ids": ids["rejected"]}
    return {"input_ids": prompt_ids + ids["answer"], "labels": [IGNORE] * len(prompt_ids) + ids["answer"]}


class InboxDataset(Dataset):
    """The taught samples of a run, index = order taught."""

    def __init__(self, tokenizer, max_length: int, path: str | Path):
        self.tokenizer, self.max_length, self.path = tokenizer, max_length, Path(path)
        self.ids: list[str] = []
        self.pairs: list[tuple[str, str]] = []
        self.rejected: list[str | None] = []  # a preference's worse answer, None for a taught answer
        self.samples: list[dict] = []
        self.forgotten: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]

    @property
    def lengths(self) -> list[int]:
        return [len(s["input_ids"]) if "input_ids" in s else
                len(s["prompt_ids"]) + max(len(s["chosen_ids"]), len(s["rejected_ids"])) for s in self.samples]

    def add(self, entry_id: str, prompt: str, answer: str, rejected: str | None = None) -> int:
        """Take a taught pair or preference (already checked with encode_pair); its index."""
        self.samples.append(encode_pair(self.tokenizer, prompt, answer, self.max_length, rejected))
        self.ids.append(entry_id)
        self.pairs.append((prompt, answer))
        self.rejected.append(rejected)
        return len(self.samples) - 1

    def index_of(self, entry_id: str) -> int:
        if entry_id not in self.ids:
            raise InboxError(f"forget: no inbox entry {entry_id!r}; the entries are "
                             f"{', '.join(self.ids) or 'none'}")
        return self.ids.index(entry_id)

    def forget(self, entry_id: str) -> None:
        self.index_of(entry_id)
        self.forgotten.add(entry_id)

    def active(self) -> list[int]:
        """Indices of the entries not forgotten."""
        return [i for i, e in enumerate(self.ids) if e not in self.forgotten]

    def state_dict(self) -> dict:
        return {"ids": list(self.ids), "forgotten": sorted(self.forgotten)}

    def load_state_dict(self, state: dict) -> None:
        """Hold exactly the entries the checkpoint's run had, read back from the inbox file."""
        known = {e.id: e for e in read_inbox(self.path)}
        missing = [i for i in state["ids"] if i not in known]
        if missing:
            raise InboxError(f"{self.path} lacks the entries {', '.join(missing)} the checkpoint trained on")
        self.ids, self.pairs, self.samples, self.rejected = [], [], [], []
        for entry_id in state["ids"]:
            self.add(entry_id, known[entry_id].prompt, known[entry_id].answer, known[entry_id].rejected)
        self.forgotten = set(state.get("forgotten", []))
