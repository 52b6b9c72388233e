"""Prompt rows of a GRPO run: {prompt, ...} read, checked (contract.data_rows.check_prompt) and
tokenized; the other columns are kept for the reward functions (contract.rewards).

A text prompt is encoded as a training `input` is (the tokenizer's special tokens, bos where it
adds one); a chat prompt (a list of messages) through the tokenizer's chat template with the
generation prompt. A prompt longer than `max_length` tokens is cut from the left (its end, where
the answer starts, is kept: TRL's `max_prompt_length`), dropped, or refused (`overlong`). Bad rows
are dropped and named by their row number in the data report, as for every format.

A batch (`collate_prompts`) holds the left-padded prompts and the dataset index of each, from
which the step takes the row's prompt and columns (`PromptDataset.rows_of`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
from torch.utils.data import Dataset

from contract.data_files import read_rows
from contract.data_rows import (CHECKS, MAX_EXAMPLES, DataError, PromptRow, RowIssue, UnreadableRow,
                                detect_rows_format)
from engine.data.report import DataReport
from engine.generation.generate import pad_ids


class PromptDataset(Dataset):
    """Samples {"prompt_ids", "index"}; `prompts[i]` and `columns[i]` the i-th sample's prompt (text
    or messages) and other columns; `rows[i]` its 1-based source row."""

    def __init__(self, ids: list[list[int]], prompts: list, columns: list[dict], rows: list[int]):
        self.ids, self.prompts, self.columns, self.rows = ids, prompts, columns, rows
        self.lengths = [len(x) for x in ids]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"prompt_ids": self.ids[index], "index": index}

    def rows_of(self, indices: Iterable[int]) -> tuple[list, dict[str, list]]:
        """(prompts, {column: values}) of the samples at `indices`, in order; a column a row lacks is None."""
        indices = list(indices)
        names = dict.fromkeys(k for i in indices for k in self.columns[i])
        return ([self.prompts[i] for i in indices],
                {n: [self.columns[i].get(n) for i in indices] for n in names})


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """A prompt's token ids (see the module docstring)."""
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
        eos = tokenizer.eos_token_id
        return ids[:-1] if ids and len(ids) > 1 and ids[-1] == eos else ids  # the prompt must not end
    out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def build_prompt_dataset(source: str | Path | Iterable[dict], tokenizer, max_length: int = 512,
                         overlong: str = "truncate") -> tuple[PromptDataset, DataReport]:
    """Read, check and tokenize the prompt rows of `source`; DataError when it cannot be read, is
    not prompt rows, has an overlong prompt under overlong="error", or leaves no usable row."""
    name, rows = read_rows(source)
    if not rows:
        raise DataError(f"data: {name} has no rows")
    report = DataReport(name, max_length=max_length, rows_read=len(rows))
    report.format = detect_rows_format(name, rows)
    if report.format != "prompt":
        raise DataError(f"data: grpo trains on prompt rows ({{prompt, ...}}; the other columns go to "
                        f"the reward functions), but {name} holds {report.format} rows")
    ids, prompts, columns, kept, too_long = [], [], [], [], []
    for number, row in rows:
        try:
            if isinstance(row, UnreadableRow):
                raise RowIssue("invalid JSON", row.detail)
            checked: PromptRow = CHECKS["prompt"](row)
            encoded = encode_prompt(tokenizer, checked.prompt)
        except RowIssue as issue:
            report.drop(number, issue.reason, issue.detail)
            continue
        except Exception as e:  # a chat template can raise anything
            report.drop(number, "chat template", f"the chat template failed: {type(e).__name__}: {e}")
            continue
        if len(encoded) > max_length:
            if overlong == "error":
                too_long.append(number)
                continue
            if overlong == "drop":
                report.drop(number, "overlong", f"{len(encoded)} tokens, more than max_length={max_length}")
                continue
            encoded = encoded[-max_length:]
            report.truncate(number)
        report.total_tokens += len(encoded)
        ids.append(encoded)
        prompts.append(checked.prompt)
        columns.append(checked.columns)
        kept.append(number)
    if too_long:
        shown = ", ".join(map(str, too_long[:MAX_EXAMPLES]))
        raise DataError(f"data: {len(too_long)} prompts of {name} are longer than max_length={max_length} "
                        f"tokens (rows {shown}); raise data.max_length or set data.overlong to truncate or drop")
    report.rows_kept = len(ids)
    if not ids:
        raise DataError(f"data: no usable row in {name} (format prompt).\n{report.summary()}")
    return PromptDataset(ids, prompts, columns, kept), report


def collate_prompts(samples: list[dict], pad: int) -> dict[str, Any]:
    """Left-padded prompts ("input_ids", "attention_mask") and the samples' dataset "index"."""
    batch = pad_ids([list(s["prompt_ids"]) for s in samples], pad, "cpu", left=True)
    batch["index"] = torch.tensor([int(s["index"]) for s in samples], dtype=torch.long)
    return batch
