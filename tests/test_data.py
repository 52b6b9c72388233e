"""The data layer: formats and their label masks, files, bad rows, batching, packing, sampling."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from engine.data import (IGNORE, DataError, DistributedBatchSampler, PackedDataset, PaddingCollator,
                         build_dataloader, build_dataset, count_tokens, load_rows, pack_lengths)


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# -- formats and label masks ---------------------------------------------------------------------

def test_text_format_learns_every_token_and_ends_with_eos(tiny_tokenizer):
    tok = tiny_tokenizer
    ds, report = build_dataset([{"text": "abc"}], tok, format="text")
    expected = [tok.bos_token_id, *ids_of(tok, "abc"), tok.eos_token_id]
    assert ds[0] == {"input_ids": expected, "labels": expected}
    assert (report.rows_read, report.rows_kept, report.total_tokens, report.trained_tokens) == (1, 1, 5, 4)


def test_input_output_learns_only_the_output_and_eos(tiny_tokenizer):
    tok = tiny_tokenizer
    ds, _ = build_dataset([{"input": "ab", "output": "cd"}], tok)
    sample = ds[0]
    assert sample["input_ids"] == [tok.bos_token_id, *ids_of(tok, "abcd"), tok.eos_token_id]
    assert sample["labels"] == [IGNORE, IGNORE, IGNORE, *ids_of(tok, "cd"), tok.eos_token_id]


CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]


def expected_chat(tok, messages):
    """The conftest template, built token by token: each turn <|role|> \\n content <|end|> \\n;
    an assistant turn is learned from its content to its closing newline."""
    ids, labels = [tok.bos_token_id], [IGNORE]
    for m in messages:
        head = tok.convert_tokens_to_ids([f"<|{m['role']}|>"]) + ids_of(tok, "\n")
        body = ids_of(tok, m["content"]) + tok.convert_tokens_to_ids(["<|end|>"]) + ids_of(tok, "\n")
        ids += head + body
        labels += [IGNORE] * len(head) + (body if m["role"] == "assistant" else [IGNORE] * len(body))
    return ids, labels


def test_chat_learns_only_the_assistant_turns(tiny_tokenizer):
    ds, report = build_dataset([{"messages": CONVERSATION}], tiny_tokenizer)
    assert report.format == "chat"
    ids, labels = expected_chat(tiny_tokenizer, CONVERSATION)
    assert ds[0] == {"input_ids": ids, "labels": labels}


def test_chat_generation_marks_give_the_same_labels(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}"
        "{% generation %}{{ m['content'] }}<|end|>\n{% endgeneration %}{% else %}{{ m['content'] }}"
        "<|end|>\n{% endif %}{% endfor %}")
    ds, _ = build_dataset([{"messages": CONVERSATION}], tok, format="chat")
    assert ds[0] == dict(zip(("input_ids", "labels"), expected_chat(tok, CONVERSATION)))


def test_chat_template_that_rewrites_history_is_reported(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)  # earlier assistant turns lose their content, like "thinking"
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] != 'assistant' "
                         "or loop.last %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}]
    ds, report = build_dataset(rows, tok)
    assert len(ds) == 1 and report.drop_reasons == {"chat template": 1}
    assert report.problems[0].row == 1 and "differently" in report.problems[0].detail


def test_tokenized_rows_are_taken_as_they_are(tiny_tokenizer):
    rows = [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}]
    ds, _ = build_dataset(rows, tiny_tokenizer)
    assert ds[0] == {"input_ids": [5, 6, 7], "labels": [5, 6, 7]}
    assert ds[1] == {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}


def test_auto_refuses_mixed_rows(tiny_tokenizer):
    rows = [{"text": "abc"}, {"text": "de"}, {"input": "a", "output": "b"}, {"text": "f"}]
    with pytest.raises(DataError, match=r"row 1 is text but row 3 is input_output"):
        build_dataset(rows, tiny_tokenizer)
    ds, report = build_dataset(rows, tiny_tokenizer, format="text")  # explicit: row 3 is a bad row
    assert len(ds) == 3 and [p.row for p in report.problems] == [3]
    with pytest.raises(DataError, match="no row has the keys of any format"):
        build_dataset([{"question": "x"}], tiny_tokenizer)
    # a prompt-only row is GRPO's format: refused for supervised training, naming what it trains
    with pytest.raises(DataError, match="prompt rows .* preference.objective grpo"):
        build_dataset([{"prompt": "x"}], tiny_tokenizer)


# -- files ---------------------------------------------------------------------------------------

ROWS = [{"input": "ab", "output": "cd"}, {"input": "hello ", "output": "world"}]


def write_as(kind: str, tmp_path, tmp_jsonl):
    import datasets
    import pandas as pd
    if kind == "jsonl":
        return tmp_jsonl(ROWS)
    if kind == "json":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps(ROWS))
        return path
    if kind in ("csv", "parquet"):
        path = tmp_path / f"rows.{kind}"
        frame = pd.DataFrame(ROWS)
        frame.to_csv(path, index=False) if kind == "csv" else frame.to_parquet(path)
        return path
    saved = datasets.Dataset.from_list(ROWS)
    if kind == "dataset_dict":
        saved = datasets.DatasetDict({"train": saved})
    saved.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "saved", "dataset_dict"])
def test_every_file_type_gives_the_same_samples(kind, tiny_tokenizer, tmp_path, tmp_jsonl):
    path = write_as(kind, tmp_path, tmp_jsonl)
    assert load_rows(path) == ROWS
    ds, report = build_dataset(path, tiny_tokenizer)
    reference, _ = build_dataset(ROWS, tiny_tokenizer)
    assert ds.samples == reference.samples and report.source == str(path)


def test_unreadable_sources_name_the_file(tiny_tokenizer, tmp_path):
    import datasets
    with pytest.raises(DataError, match="no such file"):
        build_dataset(tmp_path / "nope.jsonl", tiny_tokenizer)
    (tmp_path / "rows.txt").write_text("x")
    with pytest.raises(DataError, match=r"rows.txt.*allowed: .jsonl"):
        build_dataset(tmp_path / "rows.txt", tiny_tokenizer)
    (tmp_path / "obj.json").write_text('{"text": "a"}')
    with pytest.raises(DataError, match="obj.json must hold a JSON list"):
        build_dataset(tmp_path / "obj.json", tiny_tokenizer)
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read .*bad.parquet as Parquet"):
        build_dataset(tmp_path / "bad.parquet", tiny_tokenizer)
    two = datasets.DatasetDict({s: datasets.Dataset.from_list(ROWS) for s in ("train", "test")})
    two.save_to_disk(str(tmp_path / "two"))
    with pytest.raises(DataError, match=r"splits \['test', 'train'\]; name one"):
        build_dataset(tmp_path / "two", tiny_tokenizer)


# -- bad rows, truncation ------------------------------------------------------------------------

def test_every_bad_row_is_reported_with_its_row_number(tiny_tokenizer, tmp_path):
    lines = ['{"input": "a", "output": "b"}', '{"input": "a"', '{"input": "a"}',
             '{"input": "a", "output": 7}', '{"input": "a", "output": "  "}', '["a", "b"]', "",
             '{"input": "a", "output": "bb"}']
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    ds, report = build_dataset(path, tiny_tokenizer, format="input_output")
    got = [(p.row, p.reason, p.detail) for p in report.problems]
    assert got == [(2, "invalid JSON", "line 2 of bad.jsonl is not valid JSON (Expecting ',' delimiter)"),
                   (3, "missing key", "missing key 'output'"),
                   (4, "wrong type", "'output' must be a string, not int"),
                   (5, "empty", "'output' is empty"),
                   (6, "wrong type", "a row must be an object with keys, not list")]
    assert (report.rows_read, report.rows_kept, report.dropped, len(ds)) == (7, 2, 5, 2)
    assert ds.rows == [1, 8]  # line numbers: the blank line 7 is not a row
    assert "row 4: 'output' must be a string, not int" in report.summary()


def test_bad_chat_and_tokenized_rows(tiny_tokenizer):
    chats = [{"messages": "hi"}, {"messages": [{"role": "user", "content": "hi"}]},
             {"messages": [{"role": "user", "content": 3}]}, {"messages": CONVERSATION}]
    _, report = build_dataset(chats, tiny_tokenizer, format="chat")
    assert [(p.row, p.reason) for p in report.problems] == [
        (1, "wrong type"), (2, "no assistant turn"), (3, "wrong type")]
    assert "'messages[0].content' must be a string" in report.problems[2].detail
    rows = [{"input_ids": [1, 2], "labels": [1]}, {"input_ids": [1, 10_000]}, {"input_ids": [1, True]},
            {"input_ids": [4]}, {"input_ids": [4, 5]}]
    _, report = build_dataset(rows, tiny_tokenizer, format="tokenized")
    assert [(p.row, p.reason) for p in report.problems] == [
        (1, "wrong type"), (2, "token out of range"), (3, "wrong type"), (4, "nothing to learn")]


def test_overlong_samples_are_truncated_dropped_or_refused_and_counted(tiny_tokenizer):
    rows = [{"input": "a", "output": "b"}, {"input": "a", "output": "x" * 20},
            {"input": "y" * 20, "output": "b"}, {"input": "a", "output": "z" * 30}]
    ds, report = build_dataset(rows, tiny_tokenizer, max_length=10)
    assert report.truncated == 2 and report.truncated_rows == [2, 4]
    assert report.problems[0].row == 3 and report.problems[0].reason == "nothing to learn"
    assert "after truncation" in report.problems[0].detail
    assert max(ds.lengths) == 10 and len(ds) == 3 and "2 truncated" in report.summary()
    _, report = build_dataset(rows, tiny_tokenizer, max_length=10, overlong="drop")
    assert report.truncated == 0 and report.drop_reasons == {"overlong": 3}
    assert [p.row for p in report.problems] == [2, 3, 4]
    with pytest.raises(DataError, match=r"3 rows .* longer than max_length=10 tokens \(rows 2, 3, 4\)"):
        build_dataset(rows, tiny_tokenizer, max_length=10, overlong="error")


def test_no_usable_row_and_bad_arguments_raise(tiny_tokenizer):
    with pytest.raises(DataError, match=r"no usable row(.|\n)*1 empty"):
        build_dataset([{"text": " "}], tiny_tokenizer)
    with pytest.raises(DataError, match="data.format must be one of"):
        build_dataset([{"text": "a"}], tiny_tokenizer, format="alpaca")
    with pytest.raises(DataError, match="data.overlong must be one of"):
        build_dataset([{"text": "a"}], tiny_tokenizer, overlong="wrap")
    assert issubclass(DataError, ValueError)


# -- collation -----------------------------------------------------------------------------------

def test_right_padding_for_training_and_left_for_generation(tiny_tokenizer):
    pad = tiny_tokenizer.pad_token_id
    samples = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = PaddingCollator(tiny_tokenizer)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, pad, pad]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert count_tokens(batch) == 4
    prompts = PaddingCollator(tiny_tokenizer, padding_side="left")([{"input_ids": [5, 6]}, {"input_ids": [8]}])
    assert set(prompts) == {"input_ids", "attention_mask"}
    assert prompts["input_ids"].tolist() == [[5, 6], [pad, 8]]
    assert prompts["attention_mask"].tolist() == [[1, 1], [0, 1]]
    no_pad = copy.deepcopy(tiny_tokenizer)
    no_pad.pad_token = None
    assert PaddingCollator(no_pad).pad_id == tiny_tokenizer.eos_token_id


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
