"""Preference rows -> token ids, and preference samples -> padded batches.

Two formats (declared and checked in `contract.data_rows`): pairs {prompt, chosen, rejected} and
unpaired judged answers {prompt, completion, label} (KTO). Tokenized as TRL's DPOTrainer and
KTOTrainer do, so that the same rows give the same ids:

* text: the prompt is encoded with the tokenizer's special tokens (bos where it adds one); prompt
  + answer is encoded as one text and followed by eos; the answer is what follows the longest
  common prefix of the two encodings (where tokens merge across the boundary, the prompt keeps
  the shared part);
* chat: the prompt is rendered by the chat template with the generation prompt, prompt + answer
  without; the template decides the special tokens (no eos is added), the answer again starts
  where the two encodings part.

Length: a pair is as long as its prompt and its longer answer. A row whose prompt alone fills
`max_length` has no answer token left and is dropped (reported); a longer row is truncated at its
end (TRL's keep_start), dropped or refused, as `data.overlong` says.

Batches (`collate_pairs`, `collate_unpaired`): a pair batch holds the chosen rows then the
rejected rows (2B rows), labels -100 on the prompt and on padding. An unpaired batch also holds
the KL rows KTO estimates its reference point on: each prompt with the completion of the row
before it in the micro-batch (the first with the last), as TRL builds them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from contract.data_rows import IGNORE, PreferenceRow, RowIssue
from engine.data.report import DataReport


class PreferenceDataset(Dataset):
    """Samples {"prompt_ids", "chosen_ids", "rejected_ids"} (pairs) or {"prompt_ids",
    "completion_ids", "label"} (unpaired); a sample's length (`lengths`, for length-aware
    batching) is its prompt and longer answer; `rows` the 1-based source row of each sample."""

    def __init__(self, samples: list[dict], rows: list[int] | None = None):
        self.samples = samples
        self.lengths = [len(s["prompt_ids"]) + max(len(a) for a in answers_of(s)) for s in samples]
        self.rows = rows if rows is not None else list(range(1, len(samples) + 1))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def answers_of(sample: dict) -> list[list[int]]:
    if "chosen_ids" in sample:
        return [sample["chosen_ids"], sample["rejected_ids"]]
    return [sample["completion_ids"]]


# -- encoding ----------------------------------------------------------------------------------

def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ids(out: Any) -> list[int]:
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


def _auto_eos(tokenizer) -> bool:
    """Whether the tokenizer ends every encoded text with eos (T5-style)."""
    eos = tokenizer.eos_token_id
    return eos is not None and _ids(tokenizer("a"))[-1:] == [eos]


def _encode_text(tokenizer, prompt_ids: list[int], fulls: list[list[int]],
                 auto_eos: bool) -> tuple[list[int], list[list[int]]]:
    """From the encodings of the prompt and of prompt + each answer (with special tokens)."""
    eos = tokenizer.eos_token_id
    if auto_eos:
        prompt_ids = prompt_ids[:-1]
    elif eos is not None:
        fulls = [full + [eos] for full in fulls]
    return _split(prompt_ids, fulls)


def _encode_chat(tokenizer, prompt: list[dict], answers: tuple) -> tuple[list[int], list[list[int]]]:
    try:
        prompt_ids = _ids(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True))
        fulls = [_ids(tokenizer.apply_chat_template(prompt + list(answer), tokenize=True, return_dict=True))
                 for answer in answers]
    except Exception as e:  # a Jinja template can raise anything (raise_exception, ...)
        raise RowIssue("chat template", f"the chat template failed: {type(e).__name__}: {e}") from None
    return _split(prompt_ids, fulls)


def _split(prompt_ids: list[int], fulls: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """The shared prompt and each answer: the answers start where the encodings part."""
    cut = min(_common_prefix(prompt_ids, full) for full in fulls)
    return prompt_ids[:cut], [full[cut:] for full in fulls]


def encode_row(tokenizer, row: PreferenceRow, text_ids: tuple | None = None, auto_eos: bool | None = None) -> dict:
    """The sample of one checked preference row (RowIssue if an answer has no token);
    `text_ids`: a text row's (prompt ids, [prompt + answer ids]) when already encoded."""
    if row.chat:
        prompt_ids, answers = _encode_chat(tokenizer, row.prompt, row.answers)
    else:
        if text_ids is None:
            text_ids = (_ids(tokenizer(row.prompt)), [_ids(tokenizer(row.prompt + a)) for a in row.answers])
        auto = _auto_eos(tokenizer) if auto_eos is None else auto_eos
        prompt_ids, answers = _encode_text(tokenizer, *text_ids, auto)
    if any(not a for a in answers):
        raise RowIssue("empty", "an answer encodes to no token after the prompt")
    if row.label is None:
        return {"prompt_ids": prompt_ids, "chosen_ids": answers[0], "rejected_ids": answers[1]}
    return {"prompt_ids": prompt_ids, "completion_ids": answers[0], "label": row.label}


def encode_preference(tokenizer, rows: list[PreferenceRow]) -> list[dict | RowIssue]:
    """The samples of checked rows; the text rows' encodings in two batched tokenizer calls."""
    texts = [r for r in rows if not r.chat]
    prompts = _batched(tokenizer, [r.prompt for r in texts])
    fulls = iter(_batched(tokenizer, [r.prompt + a for r in texts for a in r.answers]))
    encoded = {id(r): (p, [next(fulls) for _ in r.answers]) for r, p in zip(texts, prompts)}
    out: list[dict | RowIssue] = []
    auto_eos = _auto_eos(tokenizer)
    for row in rows:
        try:
            out.append(encode_row(tokenizer, row, encoded.get(id(row)), auto_eos))
        except RowIssue as issue:
            out.append(issue)
    return out


def _batched(tokenizer, texts: list) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts)["input_ids"]] if texts else []


def limit(number: int, sample: dict, max_length: int, overlong: str, report: DataReport,
          overlong_rows: list[int]) -> dict | None:
    """Apply the length policy to one sample (None: dropped or refused); count what happens."""
    prompt = len(sample["prompt_ids"])
    if prompt >= max_length:
        report.drop(number, "prompt fills max_length", f"the prompt alone has {prompt} tokens, "
                    f"max_length={max_length} leaves no answer token")
        return None
    longest = prompt + max(len(a) for a in answers_of(sample))
    if longest > max_length:
        if overlong == "drop":
            report.drop(number, "overlong", f"{longest} tokens, more than max_length={max_length}")
            return None
        if overlong == "error":
            overlong_rows.append(number)
            return None
        keep = max_length - prompt  # the end of each answer goes (TRL's keep_start)
        sample = {k: (v[:keep] if k in ("chosen_ids", "rejected_ids", "completion_ids") else v)
                  for k, v in sample.items()}
        report.truncate(number)
    answers = answers_of(sample)
    report.total_tokens += prompt * len(answers) + sum(len(a) for a in answers)
    report.trained_tokens += sum(len(a) for a in answers)
    return sample


# -- batches -------------------------------------------------------------------------------------

def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def _sequences(prompts: list[list[int]], answers: list[list[int]], pad_id: int,
               max_length: int | None = None) -> dict[str, torch.Tensor]:
    ids = [p + a for p, a in zip(prompts, answers)]
    labels = [[IGNORE] * len(p) + a for p, a in zip(prompts, answers)]
    if max_length is not None:
        ids, labels = [x[:max_length] for x in ids], [x[:max_length] for x in labels]
    return {"input_ids": _pad(ids, pad_id), "attention_mask": _pad([[1] * len(x) for x in ids], 0),
            "labels": _pad(labels, IGNORE)}


def collate_pairs(samples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows first, then rejected rows, right-padded to the longest."""
    prompts = [s["prompt_ids"] for s in samples] * 2
    answers = [s["chosen_ids"] for s in samples] + [s["rejected_ids"] for s in samples]
    return _sequences(prompts, answers, pad_id)


def collate_unpaired(samples: list[dict], pad_id: int, max_length: int | None = None) -> dict[str, torch.Tensor]:
    """The rows, their KL rows (each prompt with the previous row's completion) and `desirable`."""
    prompts = [s["prompt_ids"] for s in samples]
    completions = [s["completion_ids"] for s in samples]
    batch = _sequences(prompts, completions, pad_id)
    kl = _sequences(prompts, completions[-1:] + completions[:-1], pad_id, max_length)
    batch.update({f"kl_{k}": v for k, v in kl.items()})
    batch["desirable"] = torch.tensor([bool(s["label"]) for s in samples])
    return batch
