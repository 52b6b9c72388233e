"""The mixture of training sources (engine.data.mixture), in one process, without DeepSpeed:
one source draws exactly the plain sampler's batches, several sources draw deterministically
from the seed in proportion to their weights, the ranks agree and split each global batch, a
saved position resumes the very same draws (after live changes, teach schedules and forgotten
inbox entries), and the config and commands refuse bad sources naming the field."""

from __future__ import annotations

import json
import math

import pytest

from contract import inbox as inbox_file
from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.protocol.base import ProtocolError
from contract.protocol.data_commands import SetWeight, Teach
from contract.protocol.commands import command_from_wire
from engine.data.dataset import TokenizedDataset
from engine.data.inbox import InboxDataset, encode_pair
from engine.data.mixture import MixtureDataset, Source, source_seed
from contract.data_rows import DataError
from engine.data.sampler import DistributedBatchSampler


def dataset(n: int, offset: int = 0) -> TokenizedDataset:
    return TokenizedDataset([{"input_ids": [offset + i] * (3 + i % 7), "labels": [1] * (3 + i % 7)}
                             for i in range(n)])


def mixture(sizes: dict[str, int], weights: dict[str, float] | None = None, *, rank: int = 0, dp: int = 2,
            micro: int = 4, seed: int = 7, strategy: str = "random"):
    sources = [Source(name, dataset(n, 1000 * i), weight=(weights or {}).get(name, 1.0),
                      seed=source_seed(seed, name, first=i == 0)) for i, (name, n) in enumerate(sizes.items())]
    data = MixtureDataset(sources, build=lambda spec: dataset(spec["samples"], 9000))
    view = data.batch_sampler(micro_batch_size=micro, dp_rank=rank, dp_size=dp, seed=seed,
                              strategy=strategy, max_length=64)
    return data, view


def draws(view, epochs: int = 1) -> list[list[tuple[int, int]]]:
    out = []
    for e in range(view.epoch, view.epoch + epochs):
        view.set_epoch(e)
        out += list(view)
    return out


@pytest.mark.parametrize("strategy", ["random", "group_by_length"])
def test_one_source_draws_the_plain_samplers_batches_on_every_rank(strategy):
    for rank in range(2):
        _, view = mixture({"train": 103}, rank=rank, strategy=strategy)
        plain = DistributedBatchSampler(dataset(103).lengths, 4, rank, 2, seed=7, strategy=strategy)
        expected = plain.rank_batches(0) + plain.rank_batches(1) + plain.rank_batches(2)
        assert [[i for _, i in b] for b in draws(view, 3)] == expected


def test_weights_decide_the_share_deterministically_and_the_ranks_split_each_batch():
    weights = {"a": 3.0, "b": 1.0, "c": 0.0}
    runs = [mixture({"a": 400, "b": 400, "c": 400}, weights, rank=r)[1] for r in (0, 1)]
    again = mixture({"a": 400, "b": 400, "c": 400}, weights, rank=0)[1]
    first, second = draws(runs[0]), draws(runs[1])
    assert first == draws(again)  # the seed decides
    counts = runs[0].mixture.take_counts()
    assert "c" not in counts and counts["a"] + counts["b"] == runs[0].num_batches * 8
    assert abs(counts["a"] / (counts["a"] + counts["b"]) - 0.75) < 0.06
    for b0, b1 in zip(first, second):  # the two ranks' shares: disjoint samples of one global batch
        assert len(b0) == len(b1) == 4 and not set(b0) & set(b1)
    other = mixture({"a": 400, "b": 400, "c": 400}, weights, seed=8)[1]
    assert draws(other) != first


def test_a_saved_position_resumes_the_same_draws_after_live_changes():
    data, view = mixture({"a": 90, "b": 50})
    m = view.mixture
    view.set_epoch(0)
    it = iter(view)
    history = [next(it) for _ in range(5)]
    key = m.add(Source("extra", dataset(30, 5000), path="extra.jsonl"))
    m.find("a").weight = 0.5
    m.schedules.append({"source": key, "index": 3, "per_step": 2, "steps_left": 4, "id": "x"})
    history += [next(it) for _ in range(2)]
    m.find("b").removed = True
    state = json.loads(json.dumps(view.state_dict(batches_done=7)))  # as trainer_state.json holds it
    rest = [next(it) for _ in range(view.num_batches - 7)]
    assert sum(1 for b in history[5:] for k, i in b if (k, i) == (key, 3)) >= 2  # scheduled slots drawn
    assert all(k != 1 for b in rest for k, _ in b)  # removed: never drawn again

    fresh, view2 = mixture({"a": 90, "b": 50})
    fresh.build = lambda spec: dataset(spec["samples"], 5000)
    view2.load_state_dict(state)
    assert view2.start_batch == 7 and [s.name for s in fresh.sources] == ["a", "b", "extra"]
    assert list(view2) == rest
    assert view2.mixture.describe() == m.describe()


def test_an_older_position_is_kept_for_a_checkpoint_after_extra_draws():
    _, view = mixture({"a": 90})
    view.set_epoch(0)
    it = iter(view)
    for _ in range(4):
        next(it)
    at_two = view.state_dict(batches_done=2)
    assert at_two["batch"] == 2 and at_two["mixture"]["drawn"] == 2
    assert at_two["mixture"]["sources"][0]["consumed"] == 2 * 8


def test_resume_refuses_other_data_naming_what_differs():
    _, view = mixture({"a": 90, "b": 50})
    state = view.state_dict()
    _, other = mixture({"a": 90, "b": 50}, micro=2)
    with pytest.raises(DataError, match="batch_size"):
        other.load_state_dict(state)
    _, changed = mixture({"a": 90, "b": 51})
    with pytest.raises(DataError, match="'b'.*51 samples now, 50 at the checkpoint"):
        changed.load_state_dict(state)


def test_the_mixture_keeps_a_source_with_weight():
    _, view = mixture({"a": 90, "b": 50})
    m = view.mixture
    m.check_weights(m.find("a"), 0.0)  # b still trains
    m.find("b").weight = 0.0
    with pytest.raises(DataError, match="at least one source must keep a weight above 0"):
        m.check_weights(m.find("a"), 0.0)
    with pytest.raises(DataError, match="no source named 'zzz'"):
        m.find("zzz")


def test_inbox_file_is_append_only_and_durable(tmp_path, default_tokenizer):
    path = tmp_path / inbox_file.INBOX_FILE
    first = inbox_file.add_entry(path, inbox_file.next_id(path), "<s>capital: zorb\n", "qux", 3)
    second = inbox_file.add_entry(path, inbox_file.next_id(path), "<s>capital: blim\n", "fep", 4)
    inbox_file.forget_entry(path, first.id, 5)
    with open(path, "a") as f:
        f.write('{"op": "add", "id": "t9", "prom')  # a line cut short by a crash: ignored
    entries = inbox_file.read_inbox(path)
    assert [(e.id, e.removed) for e in entries] == [("t1", True), ("t2", False)] and second.id == "t2"
    assert inbox_file.next_id(path) == "t3"
    with pytest.raises(inbox_file.InboxError, match="`answer` is empty"):
        inbox_file.add_entry(path, "t3", "<s>x\n", "  ", 1)

    data = InboxDataset(default_tokenizer, 32, path)
    data.add("t2", "<s>capital: blim\n", "fep")
    sample = data[0]
    prompt_len = len(default_tokenizer("<s>capital: blim\n", add_special_tokens=False)["input_ids"])
    assert sample["labels"][:prompt_len] == [-100] * prompt_len
    assert default_tokenizer.decode(sample["input_ids"][prompt_len:], skip_special_tokens=True) == "fep"
    data.forget("t2")
    assert data.active() == [] and data.state_dict() == {"ids": ["t2"], "forgotten": ["t2"], "pairs_as": "pairs"}
    with pytest.raises(inbox_file.InboxError, match="longer than data.max_length=32"):
        encode_pair(default_tokenizer, "<s>q\n", "a" * 40, 32)
    # each fits, not both: the message gives both lengths and both ways out
    with pytest.raises(inbox_file.InboxError, match=r"`prompt` \(20 tokens\) and `rejected` \(21 tokens with EOS\)"
                       r".* shorten either, or raise data.max_length"):
        encode_pair(default_tokenizer, "p" * 20, "a" * 5, 32, rejected="r" * 20)


def test_bad_sources_and_data_commands_are_refused_naming_the_field(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"text": "hello"}\n')
    with pytest.raises(ConfigError) as e:
        load_config(data={"data": {"sources": [
            {"path": str(good), "weight": -1}, {"path": str(tmp_path / "gone.jsonl")},
            {"path": str(good), "format": "csv", "colour": 1}]}})
    text = str(e.value)
    for expected in ("data.sources[0].weight: must be a number >= 0", "data.sources[1].path: no such file",
                     "data.sources[2].format", "data.sources[2]: unknown key colour",
                     "data.sources[2].name: 'a' names two sources"):
        assert expected in text, text
    cfg = load_config(data={"data": {"sources": [{"path": str(good), "weight": 2}]}})
    assert not cfg.uses_default_task and cfg.data.sources[0]["weight"] == 2
    for bad in ({"source": "a", "weight": -1.0}, {"source": "a", "weight": math.nan}, {"source": "", "weight": 1}):
        with pytest.raises(ProtocolError, match="set_weight: argument '(weight|source)'"):
            command_from_wire("set_weight", bad)
    with pytest.raises(ProtocolError, match="teach: argument 'answer' is empty"):
        Teach(answer="", prompt="x")
    assert SetWeight(source="a", weight=0).weight == 0.0


@pytest.fixture(scope="module")
def default_tokenizer():
    from engine.data import default_task
    from engine.model.loading import load_tokenizer
    return load_tokenizer(default_task.ensure_default_assets(default_task.default_root()).model_dir, "model.path")


def test_a_rewind_in_place_ends_the_running_epoch_view():
    _, view = mixture({"a": 90, "b": 50})
    view.set_epoch(0)
    it = iter(view)
    first = [next(it) for _ in range(3)]
    state = view.state_dict(batches_done=1)
    view.load_state_dict(state)  # what a rewind to batch 1 does, while the loop's iterator is open
    assert list(it) == []  # the old view stops; the loop starts a new one from the restored batch
    view.set_epoch(0)
    view.set_start_batch(1)
    assert next(iter(view)) == first[1]


def test_the_preflight_check_reads_every_source_naming_it(tmp_path):
    from contract.preflight import preflight
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n{"txt": 1}\n{"text": "x"}\n')
    (tmp_path / "b.jsonl").write_text('{"input": 3}\n')
    report = preflight(load_config(data={"data": {"sources": [
        {"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "b.jsonl"), "weight": 2}]}}))
    assert ("data.sources[0]", f"{tmp_path / 'a.jsonl'}: 1 of 3 rows will be dropped: row 2: missing key "
            "'text'") in report.warnings
    assert [key for key, _ in report.problems] == ["data.sources[1]"] and "b.jsonl" in report.problems[0][1]


def test_an_epoch_behind_the_run_is_drawn_again_from_a_copy():
    """`Trainer.train_loader(0)` after training (a script reading a batch): the earlier epoch's
    batches again, the run's own position untouched; not once live changes make it unknowable."""
    data, view = mixture({"a": 120, "b": 80}, {"a": 2.0, "b": 1.0})
    first = draws(view, 2)
    drawn = data.mixture.drawn
    view.set_epoch(0)
    assert list(view) == first[:len(first) // 2] and data.mixture.drawn == drawn
    view.set_epoch(2)
    later = list(view)  # the live position goes on as if nothing had been read
    data.mixture.note_change()
    view.set_epoch(0)
    with pytest.raises(DataError, match="before live data changes"):
        list(view)
    _, fresh = mixture({"a": 120, "b": 80}, {"a": 2.0, "b": 1.0})
    assert draws(fresh, 3)[len(first):] == later
