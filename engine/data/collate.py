"""Padding samples into tensors, and counting the real tokens of a batch."""

from __future__ import annotations

from typing import Any

import torch

from contract.data_rows import IGNORE
from engine.data.inbox import LIVE_PAIR, PAIR_PREFIX
from engine.data.preference import collate_pairs, collate_unpaired
from contract.data_rows import DataError


def pad_id_of(tokenizer) -> int:
    """The tokenizer's pad id, else its eos id (padding is masked out either way)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise DataError("the tokenizer has neither a pad token nor an eos token to pad with")


def _as_list(value: Any) -> list[int]:
    return value.tolist() if hasattr(value, "tolist") else list(value)


class PaddingCollator:
    """Samples -> {"input_ids", "attention_mask", "labels"} tensors, padded to the longest.

    Right padding for training (labels -100 on padding); left padding for generation, where the
    samples may carry no labels. Preference samples become pair or unpaired batches
    (engine.data.preference: chosen rows then rejected rows; KTO's KL rows); an SFT run's live
    preferences (engine.data.inbox) add their pair batch under `pair_` keys. Packed rows (samples
    with "position_ids") get no attention mask, so that transformers derives the per-sample mask
    from the positions; their padding is a tail of pad ids at position 0 with label -100, each
    pad token a one-token sequence of its own (an unpacked sample beside them: positions 0..n-1).
    """

    def __init__(self, tokenizer=None, *, pad_id: int | None = None, padding_side: str = "right"):
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', not {padding_side!r}")
        if pad_id is None and tokenizer is None:
            raise ValueError("PaddingCollator needs a tokenizer or a pad_id")
        self.pad_id = pad_id if pad_id is not None else pad_id_of(tokenizer)
        self.padding_side = padding_side

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        # preference samples (engine.data.preference) make batches of their own shape
        if "chosen_ids" in samples[0]:
            return collate_pairs(samples, self.pad_id)
        if "completion_ids" in samples[0]:
            return collate_unpaired(samples, self.pad_id)
        ids = [_as_list(s["input_ids"]) for s in samples]
        width = max(len(x) for x in ids)
        # packed rows may share a batch with the inbox's unpacked samples (each its own sequence)
        packed = any("position_ids" in s for s in samples)
        if packed and self.padding_side == "left":
            raise ValueError("packed rows are padded on the right only")
        batch = {"input_ids": self._pad(ids, width, self.pad_id)}
        if packed:
            batch["position_ids"] = self._pad([_as_list(s["position_ids"]) if "position_ids" in s
                                               else list(range(len(x))) for s, x in zip(samples, ids)], width, 0)
        else:
            batch["attention_mask"] = self._pad([[1] * len(x) for x in ids], width, 0)
        if "labels" in samples[0]:
            batch["labels"] = self._pad([_as_list(s["labels"]) for s in samples], width, IGNORE)
        pairs = [s[LIVE_PAIR] for s in samples if LIVE_PAIR in s]  # an SFT run's live preferences
        if pairs:
            batch.update({PAIR_PREFIX + k: v for k, v in collate_pairs(pairs, self.pad_id).items()})
        return batch

    def _pad(self, rows: list[list[int]], width: int, value: int) -> torch.Tensor:
        if self.padding_side == "right":
            padded = [row + [value] * (width - len(row)) for row in rows]
        else:
            padded = [[value] * (width - len(row)) + row for row in rows]
        return torch.tensor(padded, dtype=torch.long)


def count_tokens(batch: dict) -> int:
    """Real (non-padding) tokens of a collated batch.

    With an attention mask: its sum. A packed batch (position_ids, no mask) pads its tail at
    position 0, one pad per "sequence"; a real sample always has a position 1 after its 0 (every
    kept sample has at least two tokens), so a 0 followed by a 0 or by the row's end is padding.
    """
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    positions = batch.get("position_ids")
    if positions is None:
        return int(batch["input_ids"].numel())
    at_zero = positions == 0
    next_is_zero = torch.ones_like(at_zero)
    next_is_zero[:, :-1] = positions[:, 1:] == 0
    return int(positions.numel() - (at_zero & next_is_zero).sum())
