"""The tokenized-data cache (engine.data.cache): a hit gives the very samples a fresh build gives;
anything that changes the encoding misses; damage is rebuilt; bad rows are still named."""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from pathlib import Path

import pytest

from engine.data import DataError, build_dataset
from engine.data.cache import cached_dataset

ROWS = {
    "input_output": [{"input": f"q{i}: ", "output": "a" * (i % 7 + 1)} for i in range(40)],
    "text": [{"text": f"line {i} " * (i % 5 + 1)} for i in range(40)],
    "chat": [{"messages": [{"role": "user", "content": f"hi {i}"},
                           {"role": "assistant", "content": f"yo {i}"}]} for i in range(20)],
    "preference": [{"prompt": f"p{i} ", "chosen": "good", "rejected": "bad" * (i % 3 + 1)} for i in range(20)],
    "unpaired": [{"prompt": f"p{i} ", "completion": "ok", "label": i % 2 == 0} for i in range(20)],
}


class Counting:
    """build_dataset, counting its calls (a cache hit makes none)."""

    def __init__(self, delay: float = 0.0):
        self.calls, self.delay = 0, delay

    def __call__(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay)
        return build_dataset(*args, **kwargs)


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def entries(root: Path) -> list[Path]:
    return sorted(root.glob("*.npz"))


@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_a_hit_gives_the_samples_rows_and_report_of_a_fresh_build(fmt, tiny_tokenizer, tmp_path):
    data = write(tmp_path / "d.jsonl", ROWS[fmt])
    build = Counting()
    max_length = 16 if fmt == "chat" else 12  # long enough to keep every row, short enough to cut some
    settings = dict(format="auto", max_length=max_length, overlong="truncate", root=tmp_path / "cache", build=build)
    first, first_report = cached_dataset(data, tiny_tokenizer, **settings)
    second, second_report = cached_dataset(data, tiny_tokenizer, **settings)
    assert build.calls == 1 and len(entries(tmp_path / "cache")) == 1
    fresh, fresh_report = build_dataset(data, tiny_tokenizer, max_length=max_length)
    assert type(second) is type(fresh)
    assert second.samples == fresh.samples and second.rows == fresh.rows and second.lengths == fresh.lengths
    assert all(type(v) in (list, bool) for s in second.samples for v in s.values())
    assert all(type(t) is int for s in second.samples for v in s.values() if isinstance(v, list) for t in v)
    assert second_report == fresh_report == first_report
    assert second_report.truncated > 0 or fmt == "unpaired"  # truncation is kept in the report
    assert first.samples == fresh.samples


def test_a_change_to_the_file_tokenizer_or_settings_misses(tiny_tokenizer, tmp_path):
    data = write(tmp_path / "d.jsonl", ROWS["input_output"])
    build, root = Counting(), tmp_path / "cache"

    def get(path=data, tok=tiny_tokenizer, **kw):
        return cached_dataset(path, tok, **{"max_length": 32, "overlong": "truncate", **kw}, root=root, build=build)

    get()
    get()
    assert build.calls == 1
    get(max_length=33)
    get(overlong="drop")
    get(format="input_output")
    assert build.calls == 4
    other = copy.deepcopy(tiny_tokenizer)
    other.add_tokens(["<new>"])
    get(tok=other)
    templated = copy.deepcopy(tiny_tokenizer)
    templated.chat_template = "{{ messages[0]['content'] }}"
    get(tok=templated)
    assert build.calls == 6
    changed = [*ROWS["input_output"][:-1], {"input": "q: ", "output": "changed"}]
    write(data, changed)
    os.utime(data, ns=(time.time_ns(), time.time_ns() + 10**9))  # a coarse clock cannot hide it
    dataset, _ = get()
    assert build.calls == 7
    assert dataset.samples == build_dataset(data, tiny_tokenizer, max_length=32)[0].samples
    copied = write(tmp_path / "copy.jsonl", changed)  # another file (path), the same rows
    get(path=copied)
    assert build.calls == 8


def test_a_corrupt_or_truncated_entry_is_rebuilt(tiny_tokenizer, tmp_path, capfd):
    data = write(tmp_path / "d.jsonl", ROWS["input_output"])
    build, root = Counting(), tmp_path / "cache"
    expected, _ = cached_dataset(data, tiny_tokenizer, root=root, build=build)
    (entry,) = entries(root)
    whole = entry.read_bytes()
    for damaged in (b"not a zip file", whole[: len(whole) // 2], b""):
        entry.write_bytes(damaged)
        dataset, report = cached_dataset(data, tiny_tokenizer, root=root, build=build)
        assert dataset.samples == expected.samples and report.rows_kept == len(expected)
    assert build.calls == 4
    assert "unreadable" in capfd.readouterr().err
    cached_dataset(data, tiny_tokenizer, root=root, build=build)  # replaced by a good entry
    assert build.calls == 4


def test_bad_rows_are_named_every_time_and_never_cached(tiny_tokenizer, tmp_path):
    rows = [*ROWS["input_output"][:2], "{broken", {"input": "x"}, *ROWS["input_output"][2:5]]
    data = write(tmp_path / "d.jsonl", rows)
    build, root = Counting(), tmp_path / "cache"
    for _ in range(2):
        _, report = cached_dataset(data, tiny_tokenizer, format="input_output", root=root, build=build)
        assert [p.row for p in report.problems] == [3, 4]
        assert "row 3" in report.summary() and "row 4" in report.summary()
    assert build.calls == 2 and entries(root) == []
    long = write(tmp_path / "long.jsonl", [{"input": "q", "output": "a" * 40}, *ROWS["input_output"][:3]])
    for _ in range(2):
        with pytest.raises(DataError, match=r"rows 1\)"):
            cached_dataset(long, tiny_tokenizer, max_length=16, overlong="error", root=root, build=build)
    assert entries(root) == []


def test_rows_in_memory_and_a_turned_off_cache_are_built_every_time(tiny_tokenizer, tmp_path, monkeypatch):
    build, root = Counting(), tmp_path / "cache"
    for _ in range(2):
        cached_dataset(ROWS["text"], tiny_tokenizer, root=root, build=build)
    data = write(tmp_path / "d.jsonl", ROWS["text"])
    monkeypatch.setenv("LIVETUNE_DATA_CACHE", "0")
    for _ in range(2):
        cached_dataset(data, tiny_tokenizer, root=root, build=build)
    assert build.calls == 4 and entries(root) == []


def test_the_default_folder_is_under_livetune_cache(tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("LIVETUNE_CACHE", str(tmp_path / "lc"))
    cached_dataset(write(tmp_path / "d.jsonl", ROWS["text"]), tiny_tokenizer)
    assert len(entries(tmp_path / "lc" / "data-v1")) == 1


def test_processes_asking_at_once_wait_for_one_build(tiny_tokenizer, tmp_path):
    """The ranks of a run: the first to take the entry's lock encodes, the others wait and read."""
    data = write(tmp_path / "d.jsonl", ROWS["input_output"])
    build, root, got = Counting(delay=0.5), tmp_path / "cache", []
    tok = [copy.deepcopy(tiny_tokenizer) for _ in range(3)]  # one each, as separate processes have
    threads = [threading.Thread(target=lambda t=t: got.append(cached_dataset(data, t, root=root, build=build)))
               for t in tok]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert build.calls == 1
    assert all(d.samples == got[0][0].samples for d, _ in got) and len(got) == 3
    assert [p.suffix for p in root.iterdir()] == [".npz"]  # no lock file or temporary file left
