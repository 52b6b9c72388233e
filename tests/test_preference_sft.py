"""Live preference pairs sent to runs whose objective takes no pairs from files: an SFT run trains
the chosen answer as a taught one plus the pair loss of `preference.sft_pairs` (full fine-tuning:
ORPO's odds-ratio term; LoRA: DPO against the model without its adapter), a KTO run takes the
pair as two judged answers (TRL's unpair_preference_dataset). Each run takes the pair at a pause,
durably in its inbox, trains on it from the next step (its reward metrics in those steps' records
only), its margin of chosen over rejected rises, and a run resumed from a checkpoint saved right
after it repeats every later step exactly (the inbox replayed from its file). A step's loss is
checked against the SFT loss plus the mean pair loss computed apart; the inbox's unpacked samples
keep their own positions beside packed rows.

One rank, in this process (the client in a thread, through the real socket), tiny models (CI
time); the 2-rank ZeRO-3 SFT run with a live pair (full fine-tuning: ORPO's term) and its exact
resume is tests/test_teach.py's launch."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.config.schema import ConfigError
from contract.inbox import read_inbox
from contract.run_folder import read_events
from contract.protocol.answers import TeachAnswer
from engine.data import default_task
from engine.callbacks import Callback
from engine.data.collate import PaddingCollator
from engine.data.inbox import InboxDataset
from supervisor.client import RunClient
from control_runs import CONNECT_S

STEPS, PER_STEP, FOR_STEPS = 8, 2, 4
PROMPT, CHOSEN, REJECTED = "capital: zorb\n", "qux", "zorb"
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from conftest import save_tiny_llama
    work = tmp_path_factory.mktemp("sft_pairs")
    save_tiny_llama(work / "model")
    rows = default_task.make_examples(256, 5)
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "unpaired.jsonl").write_text(
        "".join(json.dumps(u) + "\n" for r in rows for u in default_task.unpaired_rows(r)))
    return work


def _overrides(work: Path, out: Path, name: str, *extra: str) -> list[str]:
    return [f"output_dir={out}", f"run_name={name}", f"max_steps={STEPS}", "batch_size=4", "precision=fp32",
            f"model.path={work / 'model'}", f"data.train={work / 'train.jsonl'}", "data.max_length=48",
            "lr=5e-3", "optim.scheduler=constant", "eval.at_end=false", "eval.every_n_steps=0",
            "logging.tensorboard=false", "checkpoint.save_at_end=false", f"teach.per_step={PER_STEP}",
            f"teach.steps={FOR_STEPS}", f"teach.check_after={FOR_STEPS}", "teach.max_new_tokens=4", *extra]


class Record(Callback):
    def __init__(self):
        self.steps: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, loss):
        self.steps[trainer.state.global_step] = {"loss": loss, **trainer.train_fn.metrics}


def _in_process(cfg, client_side, run_dir: str | None = None, resume_from: str | None = None) -> tuple:
    """Train `cfg` in this process with `client_side(client)` talking to it from a thread."""
    from engine.trainer import Trainer
    record, failures, answers = Record(), [], {}
    trainer = Trainer(config=cfg, run_dir=run_dir, callbacks=[record])
    if resume_from:
        trainer.load_checkpoint(resume_from)

    def talk():
        try:
            with RunClient.connect(trainer.folder.root, timeout=CONNECT_S) as client:
                answers.update(client_side(client))
        except Exception as e:  # noqa: BLE001 - reported by the test
            failures.append(e)
            RunClient.connect(trainer.folder.root).resume()
    thread = threading.Thread(target=talk, daemon=True) if client_side else None
    if thread:
        thread.start()
    trainer.train()
    if thread:
        thread.join(timeout=60)
    folder = trainer.folder
    trainer.close()
    assert not failures, failures
    return record.steps, answers, folder


def _take_pair(client) -> dict:
    first = client.pause().step
    taken = client.prefer(PROMPT, CHOSEN, REJECTED)
    saved = client.save()  # the pair's schedule is in the checkpoint: a resume trains it again
    client.resume()
    return {"first": first, "taken": taken, "saved": saved}


def _check_trained(steps: dict, log: list[dict], first: int, taken: TeachAnswer, rows_per_step: int) -> None:
    counts = {e["step"]: e["samples_per_source"] for e in log if e["type"] == "train"}
    for step in range(first + 1, first + FOR_STEPS + 1):  # from the next step on, PER_STEP in every batch
        assert counts[step].get("inbox") == rows_per_step, counts[step]
    pair_steps = {s for s, m in steps.items() if "rewards/margins" in m}
    assert pair_steps == set(range(first + 1, first + FOR_STEPS + 1)), pair_steps
    assert all(k in steps[first + 1] for k in PAIR_METRICS)
    records = {e["step"]: e for e in log if e["type"] == "train"}
    assert records[first + 1]["rewards/margins"] == steps[first + 1]["rewards/margins"]  # in the event log
    (check,) = [e for e in log if e["type"] == "teach_check"]
    assert check["id"] == taken.id and check["margin_before"] == taken.margin
    assert check["margin_after"] > check["margin_before"], check  # chosen gained on rejected
    assert check["prefers"] == ("chosen" if check["margin_after"] > 0 else "rejected")


@pytest.mark.slow  # two single-rank trainings in this process
def test_an_sft_lora_run_trains_a_live_pair_with_dpo_against_the_base_and_resumes_exactly(inputs, tmp_path):
    overrides = _overrides(inputs, tmp_path, "sft", "control.enabled=true", "method=lora")
    cfg = load_config(overrides=overrides)
    assert cfg.preference.sft_pairs == "auto"  # lora: DPO against the model without its adapter
    steps, answers, folder = _in_process(cfg, _take_pair)
    first, taken = answers["first"], answers["taken"]
    log = list(read_events(folder.events))
    _check_trained(steps, log, first, taken, PER_STEP)
    assert steps[first + 1]["loss"] > steps[first]["loss"]  # the SFT loss plus the pair's (about log 2 at first)
    assert "log_odds_ratio" not in steps[first + 1]  # DPO's metrics, not ORPO's
    assert [(e.answer, e.rejected) for e in read_inbox(folder.root / "inbox.jsonl")] == [(CHOSEN, REJECTED)]

    saved = answers["saved"]
    again, _, _ = _in_process(load_config(overrides=overrides), None, run_dir=str(folder.root),
                              resume_from=saved.checkpoint)
    later = {s: v for s, v in steps.items() if s > saved.step}
    assert later and again == later  # losses and pair metrics, bit for bit


@pytest.mark.slow  # two single-rank trainings in this process
def test_a_kto_run_takes_a_pair_as_two_judged_answers(inputs, tmp_path):
    def side(client):
        out = _take_pair(client)
        client.pause()
        dropped = client.prefer("capital: blim\n", "fep", "blim")
        client.forget(dropped.id)  # forgotten before any step: never drawn
        out["entries"] = client.inbox().entries
        client.resume()
        return out
    extra = ("control.enabled=true", "objective=kto", "method=lora", f"data.train={inputs / 'unpaired.jsonl'}")
    cfg = load_config(overrides=_overrides(inputs, tmp_path, "kto", *extra))
    steps, answers, folder = _in_process(cfg, side)
    first, taken = answers["first"], answers["taken"]
    log = list(read_events(folder.events))
    # TRL's unpairing: the chosen answer desirable, the rejected one undesirable, PER_STEP of each
    counts = {e["step"]: e["samples_per_source"] for e in log if e["type"] == "train"}
    assert all(counts[s].get("inbox") == 2 * PER_STEP for s in range(first + 1, first + FOR_STEPS + 1))
    assert all("inbox" not in counts[s] for s in counts if s > first + FOR_STEPS)  # the forgotten pair
    assert [(e["answer"], e["rejected"], e["removed"]) for e in answers["entries"]] == [
        (CHOSEN, REJECTED, False), ("fep", "blim", True)]
    (check,) = [e for e in log if e["type"] == "teach_check"]
    assert check["margin_after"] > check["margin_before"] == taken.margin, check

    saved = answers["saved"]
    again, _, _ = _in_process(load_config(overrides=_overrides(inputs, tmp_path, "kto", *extra)),
                              None, run_dir=str(folder.root), resume_from=saved.checkpoint)
    later = {s: v for s, v in steps.items() if s > saved.step}
    assert later and again == later


def test_the_rule_for_an_sft_runs_pairs_is_checked_before_launch():
    from contract.config.preference_checks import sft_pair_loss
    assert sft_pair_loss(load_config(overrides=["method=lora"])) == "dpo"
    assert sft_pair_loss(load_config(overrides=["preference.sft_pairs=simpo", "method=lora"])) == "simpo"
    with pytest.raises(ConfigError, match="preference.sft_pairs.*method full has none"):
        load_config(overrides=["preference.sft_pairs=dpo"])
    with pytest.raises(ConfigError, match="preference.beta.*sft_pairs"):
        load_config(overrides=["preference.sft_pairs=simpo", "preference.beta=0"])


def test_the_inbox_encodes_a_pair_for_the_runs_objective_and_a_resume_alike(tmp_path, tiny_tokenizer):
    from contract import inbox as inbox_file
    path = tmp_path / "inbox.jsonl"
    inbox_file.add_entry(path, "t1", "<s>q\n", "ab", 3, rejected="c")
    inbox_file.add_entry(path, "t2", "<s>r\n", "d", 4)
    kto = InboxDataset(tiny_tokenizer, 32, path, pairs_as="unpaired")
    assert kto.add("t1", "<s>q\n", "ab", "c") == [0, 1] and kto.add("t2", "<s>r\n", "d") == [2]
    assert [s.get("label") for s in kto.samples] == [True, False, None]  # TRL's unpairing
    kto.forget("t1")
    assert kto.active() == [2]
    again = InboxDataset(tiny_tokenizer, 32, path)  # as a resume builds it, before its state
    again.load_state_dict(kto.state_dict())
    assert again.samples == kto.samples and again.active() == [2]

    sft = InboxDataset(tiny_tokenizer, 32, path, pairs_as="sft")
    sft.add("t1", "<s>q\n", "ab", "c")
    sft.add("t2", "<s>r\n", "d")
    batch = PaddingCollator(tiny_tokenizer)(sft.samples)
    assert batch["input_ids"].shape[0] == 2  # the chosen answer is a row of the SFT batch
    assert batch["pair_input_ids"].shape[0] == 2 and batch["pair_labels"][1].tolist()[3:5] == \
        sft.samples[0]["pair"]["rejected_ids"]  # beside it, its pair: chosen row, rejected row
    assert "pair_input_ids" not in PaddingCollator(tiny_tokenizer)(sft.samples[1:])


@pytest.mark.slow  # one single-rank engine in this process
def test_a_step_with_pairs_has_the_sft_loss_plus_the_mean_pair_loss(inputs, tmp_path):
    """Two micro-batches a step, the per-micro-batch objective (DeepSpeed divides by the
    accumulation steps): the step's loss is the SFT loss of its rows plus the mean over its pairs
    of ORPO's odds-ratio term, however the pairs fall into the micro-batches."""
    import torch
    from engine.data.mixture import Source
    from engine.objectives.preference import sft_pair_objective
    from engine.objectives.losses import model_logits
    from engine.objectives.preference_step import PreferenceStep
    from engine.trainer import Trainer
    cfg = load_config(overrides=_overrides(inputs, tmp_path, "weights", "train.grad_accum=2", "batch_size=3",
                                           "train.loss_average=micro_batch", "control.enabled=false"))
    trainer = Trainer(config=cfg)
    inbox = InboxDataset(trainer.tokenizer, 48, tmp_path / "inbox.jsonl", pairs_as="sft")
    trainer.train_dataset.mixture.add(Source("inbox", inbox, format="inbox", weight=0.0, kind="inbox"))
    inbox.add("t1", "<s>capital: zorb\n", "qux", "zorb")
    inbox.add("t2", "<s>capital: blim\n", "fep", "blim")
    rows, collate = trainer.train_dataset.sources[0].dataset, PaddingCollator(trainer.tokenizer)
    micro_batches = [collate([rows[0], inbox[0], rows[1]]), collate([inbox[1], inbox[0], rows[2]])]
    with torch.no_grad():  # the expected loss, under the weights before the step
        sft = [trainer.compute_loss({k: v for k, v in b.items() if not k.startswith("pair_")}) for b in micro_batches]
        pair_losses = []
        for batch in micro_batches:
            pairs = {k.removeprefix("pair_"): v for k, v in batch.items() if k.startswith("pair_")}
            scores = PreferenceStep._scores(lambda i, m: model_logits(trainer.engine, i, m), pairs)
            mean, _ = sft_pair_objective(cfg).loss(scores, None, pairs, {})
            pair_losses += [float(mean)] * (pairs["input_ids"].size(0) // 2)
    loss, _ = trainer.train_fn(trainer, micro_batches)
    metrics = trainer.train_fn.metrics
    trainer.close()
    expected = float(sum(sft)) / 2 + sum(pair_losses) / 3
    assert float(loss) == pytest.approx(expected, rel=1e-6) and len(pair_losses) == 3
    assert set(PAIR_METRICS) <= set(metrics) and metrics["rewards/accuracies"] in (0.0, 1 / 3, 2 / 3, 1.0)


def test_an_unpacked_inbox_sample_beside_packed_rows_is_its_own_sequence(tiny_tokenizer):
    packed = {"input_ids": [1, 20, 21, 1, 22], "labels": [-100, 20, 21, -100, 22], "position_ids": [0, 1, 2, 0, 1]}
    taught = {"input_ids": [1, 30, 31], "labels": [-100, 30, 31]}  # the inbox's, first in the batch
    batch = PaddingCollator(tiny_tokenizer)([taught, packed])
    assert "attention_mask" not in batch  # positions decide the sequences
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 0, 1]]


def test_a_pair_is_refused_where_the_sft_step_cannot_train_it():
    from types import SimpleNamespace
    from engine.objectives.preference_step import SftStep, pairs_problem
    run = SimpleNamespace(config=load_config(overrides=["method=lomo"]), train_fn=None)  # the parts pairs_problem reads
    assert "lomo updates inside backward" in pairs_problem(run)
    run = SimpleNamespace(config=load_config(), train_fn=lambda trainer, batches: None)
    assert "a train_fn given in code" in pairs_problem(run)
    run = SimpleNamespace(config=load_config(), train_fn=SftStep(), data=SimpleNamespace(train_collate_fn=print))
    assert "a collate function given in code" in pairs_problem(run)
    run.data.train_collate_fn = None
    assert pairs_problem(run) is None
    assert pairs_problem(SimpleNamespace(config=load_config(overrides=["objective=kto"]))) is None
