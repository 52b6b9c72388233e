"""The data layer: rows -> tokenized samples -> padded (or packed) batches for each rank.

    dataset, report = build_dataset("train.jsonl", tokenizer, format="auto", max_length=512)
    print(report.summary())
    loader = build_dataloader(dataset, micro_batch_size=8, dp_rank=r, dp_size=n, seed=42,
                              strategy="group_by_length", tokenizer=tokenizer, max_length=512)
    loader.batch_sampler.set_epoch(epoch)

Modules: `loading` (files -> rows), `formats` and `chat` (rows -> input_ids / labels),
`dataset` (build_dataset, the report's bookkeeping), `packing`, `collate` (padding, token
counts), `sampler` (distributed batches, resume), `loader` (a DataLoader of it all).
"""

from engine.data.collate import PaddingCollator, count_tokens, pad_id_of
from engine.data.dataset import TokenizedDataset, build_dataset
from contract.data_rows import detect_rows_format
from contract.data_rows import FORMATS, IGNORE, detect_format
from engine.data.loader import build_dataloader
from contract.data_files import load_rows, read_rows
from engine.data.packing import PackedDataset, pack_lengths
from contract.data_rows import DataError
from engine.data.report import DataReport, RowProblem
from engine.data.sampler import STRATEGIES, DistributedBatchSampler

__all__ = [
    "DataError", "DataReport", "DistributedBatchSampler", "FORMATS", "IGNORE", "PackedDataset",
    "PaddingCollator", "RowProblem", "STRATEGIES", "TokenizedDataset", "build_dataloader",
    "build_dataset", "count_tokens", "detect_format", "detect_rows_format", "load_rows",
    "pack_lengths", "pad_id_of", "read_rows"]
