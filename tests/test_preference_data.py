"""Preference rows: checked and reported like the other formats, tokenized as TRL tokenizes them,
batched as pairs / unpaired rows, refused before launch where an objective cannot run."""

import json

import pytest

from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.data_check import overlong_rows, prompt_filling_rows, scan_file
from contract.data_rows import DataError, detect_format
from engine.data import PaddingCollator, build_dataset
from engine.data.default_task import OPERATIONS, ensure_default_assets, preference_row, sources_for, wrong_answer
from engine.model.loading import load_tokenizer

CHAT = [{"role": "user", "content": "upper: ab"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(ensure_default_assets(tmp_path_factory.mktemp("assets") / "a").model_dir)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_formats_are_detected_from_their_keys():
    assert detect_format({"prompt": "p", "chosen": "a", "rejected": "b"}) == "preference"
    assert detect_format({"prompt": "p", "completion": "a", "label": False}) == "unpaired"


def test_bad_rows_are_dropped_and_named_by_number(tmp_path, tok):
    path = _write(tmp_path / "pairs.jsonl", [
        {"prompt": "reverse: abc\n", "chosen": "cba", "rejected": "abc"},
        {"prompt": "p", "chosen": "same", "rejected": "same"},
        {"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
        {"prompt": CHAT, "chosen": [{"role": "user", "content": "AB"}], "rejected": [{"role": "assistant", "content": "ab"}]},
        "{not json",
        {"prompt": "x" * 80, "chosen": "a", "rejected": "b"},
        {"prompt": CHAT, "chosen": [{"role": "assistant", "content": "AB"}],
         "rejected": [{"role": "assistant", "content": "ab"}]}])
    scan = scan_file(str(path), "auto")  # the pre-flight check, before any rank starts
    assert scan.format == "preference"
    assert [n for n, _ in scan.dropped] == [2, 3, 4, 5]
    assert "same answer" in dict(scan.dropped)[2] and "mixed" not in dict(scan.dropped)[2]
    assert "'prompt' is text but 'chosen' is list" in dict(scan.dropped)[3]
    assert "must be 'assistant'" in dict(scan.dropped)[4]
    assert prompt_filling_rows(scan, 64, 1.0) == [6] and overlong_rows(scan, 64, 1.0) == [6]
    dataset, report = build_dataset(str(path), tok, max_length=64)  # the engine's build
    assert report.rows_kept == 2 and dataset.rows == [1, 7]
    assert {p.row for p in report.problems} == {2, 3, 4, 5, 6}
    assert report.drop_reasons["prompt fills max_length"] == 1


def test_empty_or_wrong_files_are_refused_by_name(tmp_path, tok):
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="empty.jsonl has no rows"):
        scan_file(str(empty), "auto")
    wrong = _write(tmp_path / "wrong.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match="cannot detect the format of .*wrong.jsonl"):
        build_dataset(str(wrong), tok)
    bad_labels = _write(tmp_path / "labels.jsonl", [{"prompt": "p", "completion": "a", "label": "yes"}])
    with pytest.raises(DataError, match="no usable row in .*labels.jsonl"):
        build_dataset(str(bad_labels), tok)


def test_text_pairs_tokenize_like_trl_and_truncate_at_the_end(tok):
    rows = [{"prompt": "reverse: abc\n", "chosen": "cba", "rejected": "abc" * 30}]
    dataset, report = build_dataset(rows, tok, max_length=32)
    sample = dataset[0]
    # TRL's DPOTrainer: prompt with special tokens; prompt + answer + eos encoded as one text
    assert sample["prompt_ids"] == tok("reverse: abc\n")["input_ids"]
    assert sample["prompt_ids"] + sample["chosen_ids"] == tok("reverse: abc\ncba</s>")["input_ids"]
    assert len(sample["prompt_ids"]) + len(sample["rejected_ids"]) == 32  # keep the start
    assert report.truncated == 1 and dataset.lengths == [32]


def test_chat_pairs_follow_the_chat_template(tok):
    rows = [{"prompt": CHAT, "chosen": [{"role": "assistant", "content": "AB"}],
             "rejected": [{"role": "assistant", "content": "ab"}]}]
    sample = build_dataset(rows, tok, max_length=64)[0][0]
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    full = tok.apply_chat_template(CHAT + rows[0]["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert sample["prompt_ids"] == list(prompt) and sample["prompt_ids"] + sample["chosen_ids"] == list(full)


def test_pair_and_unpaired_batches(tok):
    pairs, _ = build_dataset([{"prompt": "p\n", "chosen": "ab", "rejected": "c"},
                              {"prompt": "qq\n", "chosen": "d", "rejected": "efg"}], tok)
    batch = PaddingCollator(tok)([pairs[0], pairs[1]])
    assert batch["input_ids"].shape == (4, 8)  # chosen rows, then rejected rows (bos qq\n efg eos)
    assert batch["labels"][0].tolist()[3:6] == pairs[0]["chosen_ids"]
    assert batch["labels"][2].tolist()[3:5] == pairs[0]["rejected_ids"]
    assert (batch["labels"][:, :3] == -100).all() and batch["attention_mask"].sum() == 6 + 6 + 5 + 8
    single, _ = build_dataset([{"prompt": "p\n", "completion": "ab", "label": True},
                               {"prompt": "q\n", "completion": "c", "label": False},
                               {"prompt": "r\n", "completion": "de", "label": False}], tok)
    batch = PaddingCollator(tok)([single[0], single[1], single[2]])
    assert batch["desirable"].tolist() == [True, False, False]
    # KL rows: each prompt with the previous row's completion (the first with the last), as TRL does
    for row, before in ((0, 2), (1, 0), (2, 1)):
        kl = single[row]["prompt_ids"] + single[before]["completion_ids"]
        assert batch["kl_input_ids"][row].tolist()[:len(kl)] == kl


def test_default_task_preference_variant(tmp_path):
    for op in OPERATIONS:
        for word in ("abc", "aaa", "cba", "ab"):
            assert wrong_answer(op, word) != OPERATIONS[op](word)
    assert preference_row({"input": "sort: cab\n", "output": "abc"}) == {
        "prompt": "sort: cab\n", "chosen": "abc", "rejected": "bac"}
    assets = ensure_default_assets(tmp_path / "a")
    train, held_out = sources_for(assets, "kto")
    rows = [json.loads(line) for line in train.read_text().splitlines()[:2]]
    assert [r["label"] for r in rows] == [True, False] and rows[0]["prompt"] == rows[1]["prompt"]
    assert sources_for(assets, "dpo")[1].name == "eval.preference.jsonl"


@pytest.mark.parametrize("overrides, field, words", [
    (["objective=dpo", "nproc=2", "pp=2"], "preference.objective", "pipeline"),
    (["objective=orpo", "method=lomo"], "preference.objective", "lomo"),
    (["objective=simpo", "data.batching=packing"], "data.batching", "packing"),
    (["objective=kto", "batch_size=1"], "train.micro_batch_size", "at least 2"),
    (["objective=dpo", "preference.label_smoothing=0.1"], "preference.label_smoothing", "robust"),
    (["objective=dpo", "data.format=chat"], "data.format", "preference rows"),
    (["objective=kto", "data.format=preference"], "data.format", "unpaired rows"),
    (["data.format=preference"], "data.format", "set preference.objective"),
])
def test_config_refuses_what_cannot_work(overrides, field, words):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert any(key == field and words in msg for key, msg in e.value.problems), e.value.problems


def test_objective_and_rows_must_agree(tmp_path, tok):
    from engine.objectives.preference import check_data, rows_problem
    _, report = build_dataset([{"text": "hello"}], tok)
    with pytest.raises(DataError, match="dpo trains on preference rows"):
        check_data(load_config(overrides=["objective=dpo"]), {"train": report})
    _, report = build_dataset([{"prompt": "p", "chosen": "a", "rejected": "b"}], tok)
    with pytest.raises(DataError, match="set preference.objective"):
        check_data(load_config(), {"train": report})
    # the live data commands ask the same (a micro-batch holds one kind of sample)
    assert "kto trains on unpaired rows" in rows_problem(load_config(overrides=["objective=kto"]), "preference", "f")
    assert rows_problem(load_config(overrides=["objective=orpo"]), "preference", "f") is None
