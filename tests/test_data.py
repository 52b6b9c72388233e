"""The data layer: formats and their label masks, files, bad rows, collation. Batching, packing and
sampling: tests/test_data_batches.py."""

from __future__ import annotations

import copy
import json

import pytest

from engine.data import IGNORE, DataError, PaddingCollator, build_dataset, count_tokens, load_rows


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
