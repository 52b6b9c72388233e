"""The data layer's batches: length grouping, packing (samples kept apart: the logits and loss
each has alone), the distributed sampler (seeded order, disjoint full batches per rank, every
evaluation sample once, resume), the data loader built from it all."""

from __future__ import annotations

import json

import pytest
import torch

from engine.data import (IGNORE, DataError, DistributedBatchSampler, PackedDataset, PaddingCollator,
                         build_dataloader, build_dataset, count_tokens, pack_lengths)


# -- batching strategies -------------------------------------------------------------------------

def padding_share(lengths, batches) -> float:
    slots = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / slots


def test_group_by_length_pads_far_less_than_random():
    lengths = torch.randint(2, 200, (4000,), generator=torch.Generator().manual_seed(0)).tolist()
    shares = {}
    for strategy in ("random", "group_by_length"):
        sampler = DistributedBatchSampler(lengths, 8, seed=1, strategy=strategy)
        sampler.set_epoch(0)
        shares[strategy] = padding_share(lengths, list(sampler))
    assert shares["random"] > 0.4 and shares["group_by_length"] < 0.05 * shares["random"], shares
    grouped = DistributedBatchSampler(lengths, 8, dp_size=2, seed=1, strategy="group_by_length")
    first = grouped.global_batches(0)[0]
    assert max(lengths) in [lengths[i] for i in first]  # the longest batch comes first


def test_packing_fills_rows_and_keeps_samples_apart(tiny_tokenizer):
    lengths = [7, 3, 5, 9, 2, 4, 8, 1, 6]
    bins = pack_lengths(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(9))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins) and len(bins) == 5  # 45 tokens
    ds, _ = build_dataset([{"text": "abcde"}, {"text": "hello"}], tiny_tokenizer)
    packed = PackedDataset(ds, 16)
    row = packed[0]
    first, second = (ds[i] for i in packed.bins[0])
    assert row["input_ids"] == first["input_ids"] + second["input_ids"]
    assert row["position_ids"] == list(range(len(first["input_ids"]))) + list(range(len(second["input_ids"])))
    # a sample's first label is never learned; here it also stops the previous sample predicting it
    assert row["labels"] == [IGNORE] + first["labels"][1:] + [IGNORE] + second["labels"][1:]
    batch = PaddingCollator(tiny_tokenizer)([row, {**row, "input_ids": row["input_ids"][:5],
                                                   "labels": row["labels"][:5], "position_ids": [0, 1, 2, 3, 4]}])
    assert "attention_mask" not in batch and batch["position_ids"][1, 5:].eq(0).all()
    assert count_tokens(batch) == len(row["input_ids"]) + 5


def tiny_llama(tok, attn: str, use_cache: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         use_cache=use_cache, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM._from_config(config, attn_implementation=attn).eval()


# text rows: every label is learned, the bos included, so a leak across samples would show
PACK_ROWS = [{"text": "abcdefg"}, {"text": "hello there x"}, {"text": "q, a longer answer"},
             {"text": "middle"}]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_samples_have_the_logits_and_loss_they_have_alone(attn, tiny_tokenizer):
    ds, _ = build_dataset(PACK_ROWS, tiny_tokenizer)
    packed = PackedDataset(ds, 40)
    assert len(packed) == 2 and max(len(b) for b in packed.bins) >= 2  # some row holds several samples
    model, collate = tiny_llama(tiny_tokenizer, attn), PaddingCollator(tiny_tokenizer)
    batch = collate([packed[i] for i in range(len(packed))])  # two rows, the shorter one padded
    with torch.no_grad():
        out = model(**batch)
        for r, bin_ in enumerate(packed.bins):
            start = 0
            for i in bin_:
                ids = torch.tensor([ds[i]["input_ids"]])
                alone = model(input_ids=ids).logits[0]
                torch.testing.assert_close(out.logits[r, start:start + ids.shape[1]], alone,
                                           atol=1e-5, rtol=1e-5)
                start += ids.shape[1]
        padded = model(**collate([ds[i] for i in range(len(ds))])).loss
    torch.testing.assert_close(out.loss, padded, atol=1e-5, rtol=1e-5)
    assert count_tokens(batch) == sum(ds.lengths)


def test_packing_needs_the_model_without_a_kv_cache(tiny_tokenizer):
    # transformers only derives per-sample masks from position_ids when no cache is in use;
    # a model whose config has use_cache=True lets packed samples see each other.
    ds, _ = build_dataset(PACK_ROWS[:2], tiny_tokenizer)
    row = PaddingCollator(tiny_tokenizer)([PackedDataset(ds, 40)[0]])
    n = len(ds[PackedDataset(ds, 40).bins[0][0]]["input_ids"])
    del row["labels"]
    with torch.no_grad():
        logits = {c: tiny_llama(tiny_tokenizer, "sdpa", use_cache=c)(**row).logits for c in (False, True)}
    assert torch.allclose(logits[False][:, :n], logits[True][:, :n], atol=1e-6)  # first sample: same
    assert not torch.allclose(logits[False][:, n:], logits[True][:, n:], atol=1e-3)  # second: leaks


# -- the distributed sampler ---------------------------------------------------------------------

def samplers(n: int, bs: int, dp: int, **kw) -> list[DistributedBatchSampler]:
    return [DistributedBatchSampler(list(range(1, n + 1)), bs, dp_rank=r, dp_size=dp, **kw) for r in range(dp)]


def epoch_of(sampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("strategy", ["random", "group_by_length"])
def test_sampler_order_depends_on_seed_and_epoch_only(strategy):
    a, b = samplers(100, 4, 1, seed=3, strategy=strategy)[0], samplers(100, 4, 1, seed=3, strategy=strategy)[0]
    assert epoch_of(a, 0) == epoch_of(b, 0) and epoch_of(a, 1) == epoch_of(b, 1)
    assert epoch_of(a, 0) != epoch_of(a, 1)
    assert epoch_of(samplers(100, 4, 1, seed=4, strategy=strategy)[0], 0) != epoch_of(a, 0)


@pytest.mark.parametrize("strategy", ["random", "group_by_length", "packing"])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_ranks_train_disjoint_full_batches_in_equal_numbers(strategy, dp):
    for n in (24, 25, 37, 100):
        per_rank = [epoch_of(s, 1) for s in samplers(n, 4, dp, seed=0, strategy=strategy)]
        assert len({len(batches) for batches in per_rank}) == 1 and len(per_rank[0]) == n // (4 * dp)
        seen = [i for batches in per_rank for b in batches for i in b]
        assert len(seen) == len(set(seen)) == len(per_rank[0]) * 4 * dp
        assert all(len(b) == 4 for batches in per_rank for b in batches)


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_evaluation_covers_every_sample_exactly_once(dp):
    for n in range(dp, 40):
        for bs in (1, 2, 5):
            per_rank = [epoch_of(s, 0) for s in samplers(n, bs, dp, shuffle=False, drop_last=False)]
            counts = {len(batches) for batches in per_rank}
            assert len(counts) == 1 and counts == {len(samplers(n, bs, dp, drop_last=False)[0])}, (n, bs)
            assert all(b for batches in per_rank for b in batches)  # no rank ever gets an empty batch
            assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(n)), (n, bs)
    with pytest.raises(DataError, match="too few"):
        samplers(dp - 1, 2, dp, drop_last=False) if dp > 1 else samplers(3, 4, 1)


def test_resume_at_batch_k_skips_exactly_the_trained_batches(tiny_tokenizer):
    full = samplers(60, 3, 2, seed=9, strategy="group_by_length")
    trained = [epoch_of(s, 2) for s in full]
    for rank, sampler in enumerate(samplers(60, 3, 2, seed=9, strategy="group_by_length")):
        sampler.set_epoch(2)
        it = iter(sampler)
        assert [next(it) for _ in range(4)] == trained[rank][:4]
        state = json.loads(json.dumps(sampler.state_dict()))  # what a checkpoint keeps
        assert (state["epoch"], state["batch"]) == (2, 4)
        fresh = samplers(60, 3, 2, seed=9, strategy="group_by_length")[rank]
        fresh.load_state_dict(state)
        assert len(fresh) == len(trained[rank]) - 4 and list(fresh) == trained[rank][4:]
        assert fresh.state_dict()["epoch"] == 3  # the epoch is done: go on with the next one
        fresh.set_epoch(2)  # a new epoch starts at its first batch again
        assert list(fresh) == trained[rank]
    with pytest.raises(DataError, match="dp_size: saved 2, now 1"):
        samplers(60, 3, 1, seed=9, strategy="group_by_length")[0].load_state_dict(state)
    ds, _ = build_dataset([{"text": "x" * (i % 11 + 1)} for i in range(40)], tiny_tokenizer)
    loaders = [build_dataloader(ds, micro_batch_size=4, seed=5, strategy="random",
                                tokenizer=tiny_tokenizer, max_length=16) for _ in range(2)]
    loaders[1].batch_sampler.set_start_batch(3)
    whole, rest = list(loaders[0]), list(loaders[1])
    assert len(rest) == len(whole) - 3 == len(loaders[1]) and all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(whole[3:], rest))


def test_build_dataloader_for_training_packing_and_evaluation(tiny_tokenizer):
    rows = [{"input": "q" * (i % 7), "output": "a" * (i % 5 + 1)} for i in range(50)]
    ds, _ = build_dataset(rows, tiny_tokenizer)
    kw = dict(micro_batch_size=4, dp_size=2, seed=0, tokenizer=tiny_tokenizer, max_length=32)
    train = [build_dataloader(ds, dp_rank=r, strategy="group_by_length", **kw) for r in range(2)]
    batches = [list(loader) for loader in train]
    assert len(batches[0]) == len(batches[1]) == 50 // 8
    assert set(batches[0][0]) == {"input_ids", "attention_mask", "labels"}
    packed = [build_dataloader(ds, dp_rank=r, strategy="packing", **kw) for r in range(2)]
    rows_packed = len(packed[0].dataset)
    assert rows_packed < len(ds) / 3 and len(packed[0]) == rows_packed // 8
    assert sum(count_tokens(b) for loader in packed for b in loader) <= sum(ds.lengths)
    evals = [build_dataloader(ds, dp_rank=r, shuffle=False, drop_last=False, **{**kw, "micro_batch_size": 3})
             for r in range(2)]
    assert len(evals[0]) == len(evals[1])
    tokens = sum(count_tokens(b) for loader in evals for b in loader)
    assert tokens == sum(ds.lengths)  # every sample exactly once
