"""The spike guard: its decisions on plain numbers (engine.guard.decisions, no torch), its config
checks, and one 2-rank DeepSpeed launch where injected trouble meets each action
(tests/scripts/guard_check.py), three runs one after the other:

    lora, ZeRO 2    poisoned micro-batches at steps 7 and 8: step 7 is skipped before its
                    backward (DeepSpeed's optimizer steps one fewer time), step 8 reaches the
                    cap of skips in a row and pauses; a resume sent earlier lets it go on
    full, ZeRO 0    a live `set lr` far too high after step 6: step 8's loss spikes, the guard
                    rewinds to its snapshot of step 6 with the lr halved, and the run recovers
    full, ZeRO 2,   the same, but the guard can judge only after the update: it rewinds to the
    accumulation 2  checkpoint step-6 on disk
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from contract.config.schema import ConfigError, GuardConfig
from contract.config.load import load_config
from engine.guard.decisions import SpikeGuard, SpikeStatistic, Verdict, newest_good
from dist_utils import SCRIPTS, parse_results, run_deepspeed


def guard(**kw) -> SpikeGuard:
    return SpikeGuard(GuardConfig(enabled=True, **kw))


def feed(g: SpikeGuard, losses) -> list[Verdict]:
    """Judge and settle each loss in turn, as the loop does."""
    out = []
    for loss in losses:
        v = g.judge_loss(loss)
        g.settle(loss, v)
        out.append(v)
    return out


# -- the statistic ---------------------------------------------------------------------------------

def test_bound_needs_three_losses_and_is_median_plus_z_sigma_or_ratio():
    s = SpikeStatistic(window=5)
    s.add(2.0)
    s.add(2.1)
    assert s.bound(6.0, 1.2) is None
    for x in (1.9, 2.0, 2.2):
        s.add(x)
    # median 2.0; changes 0.1, 0.2, 0.1, 0.2 -> median 0.15 -> sigma 1.4826 * 0.15 / sqrt 2
    sigma = 1.4826 * 0.15 / math.sqrt(2)
    assert s.sigma() == pytest.approx(sigma)
    assert s.bound(6.0, 1.0) == pytest.approx(2.0 + 6 * sigma)
    assert s.bound(1.0, 1.5) == pytest.approx(3.0)  # the ratio term wins
    s.add(9.0)  # the window keeps the last 5
    assert list(s.losses) == [2.1, 1.9, 2.0, 2.2, 9.0]


def test_a_steadily_falling_loss_never_spikes():
    g = guard(warmup_steps=3, window=8, spike_z=4.0, spike_ratio=1.1)
    verdicts = feed(g, [6.0 - 0.2 * i + (0.03 if i % 2 else -0.03) for i in range(25)])
    assert all(v.ok for v in verdicts)


def test_spike_after_warmup_is_judged_and_not_learned():
    g = guard(warmup_steps=5, window=10, spike_z=6.0, spike_ratio=1.2, on_spike="skip")
    assert feed(g, [3.0, 9.0, 2.9, 3.1, 3.0])[1].ok  # during the warm-up a jump is only learned
    v = feed(g, [2.95, 3.05, 3.0, 8.0])
    assert [x.ok for x in v] == [True, True, True, False]
    assert (v[-1].action, v[-1].trigger) == ("skip", "loss_spike")
    assert v[-1].value == 8.0 and v[-1].threshold is not None and 3.0 < v[-1].threshold < 8.0
    assert "above the spike bound" in v[-1].reason
    assert 8.0 not in g.stat.losses  # a judged-bad loss never raises the bound
    assert g.judge_loss(3.0).ok


def test_nonfinite_loss_from_the_first_step():
    g = guard(on_nonfinite="pause")
    for bad in (math.nan, math.inf, -math.inf):
        v = g.judge_loss(bad)
        assert (v.action, v.trigger) == ("pause", "nonfinite_loss")
    assert g.judge_loss(1e6).ok  # no statistic yet: a large finite loss is fine


def test_grad_norm_bound_and_nonfinite_norm():
    g = guard(grad_norm_max=5.0, on_grad_norm="pause")
    assert g.judge_grad_norm(None).ok and g.judge_grad_norm(4.9).ok
    v = g.judge_grad_norm(7.5)
    assert (v.action, v.trigger, v.value, v.threshold) == ("pause", "grad_norm", 7.5, 5.0)
    assert g.judge_grad_norm(math.nan).trigger == "nonfinite_grad_norm"
    assert guard().judge_grad_norm(1e9).ok  # bound 0: off (non-finite still counts)
    assert guard().judge_grad_norm(math.inf).action == "rewind"


def test_skips_in_a_row_are_capped_then_pause():
    g = guard(on_nonfinite="skip", max_skips_in_a_row=2)
    verdicts = feed(g, [1.0, math.nan, math.nan, math.nan])
    assert [v.action for v in verdicts] == ["ok", "skip", "skip", "pause"]
    assert "2 steps in a row skipped already (guard.max_skips_in_a_row 2)" in verdicts[-1].reason
    g2 = guard(on_nonfinite="skip", max_skips_in_a_row=2)
    assert [v.action for v in feed(g2, [math.nan, math.nan, 1.0, math.nan, math.nan])] == ["skip"] * 2 + ["ok"] + ["skip"] * 2


def test_rewinds_are_capped_then_pause():
    g = guard(on_nonfinite="rewind", max_rewinds=2)
    actions = [v.action for v in feed(g, [math.nan] * 4)]
    assert actions == ["rewind", "rewind", "pause", "pause"]
    assert g.rewinds == 2
    last = g.judge_loss(math.nan)
    assert "rewound 2 times" in last.reason and "max_rewinds 2" in last.reason


def test_fallback_pauses_and_says_why():
    v = Verdict("rewind", "loss_spike", "the loss 9 is above the spike bound 4", 9.0, 4.0)
    f = guard().fallback(v, "there is nothing to rewind to")
    assert (f.action, f.trigger, f.value) == ("pause", "loss_spike", 9.0)
    assert f.reason.endswith("there is nothing to rewind to, so it pauses")


def test_event_fields_are_json_plain():
    e = Verdict("skip", "nonfinite_loss", "nan", math.nan, None).event(7, rewinds=0).record()
    assert e == {"type": "guard", "step": 7, "trigger": "nonfinite_loss", "action": "skip", "reason": "nan",
                 "value": "nan", "threshold": None, "rewinds": 0}


def test_newest_good_is_at_two_steps_before_or_earlier():
    cands = [("4", 4), ("8", 8), ("snapshot:guard-6", 6), ("snapshot:guard-8", 8)]
    assert newest_good(cands, 10) == ("snapshot:guard-8", 8)  # equal steps: the later (snapshot)
    assert newest_good(cands, 9) == ("snapshot:guard-6", 6)
    assert newest_good(cands, 6) == ("4", 4)
    assert newest_good(cands, 5) is None


def test_guard_state_equal_inputs_equal_decisions():
    """Every rank runs its own guard: the same inputs must give the same actions (no hidden
    state such as time or randomness)."""
    losses = [3.0, 2.9, 2.8, 2.85, 2.7, 7.0, 2.6, math.nan, 2.5]
    a, b = guard(warmup_steps=3, window=4), guard(warmup_steps=3, window=4)
    assert [v.action for v in feed(a, losses)] == [v.action for v in feed(b, losses)]


# -- config ----------------------------------------------------------------------------------------

def test_guard_config_refuses_what_cannot_work():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["guard.enabled=true", "method=lomo", "train.grad_accum=1"])
    assert "guard.on_nonfinite" in str(e.value) and "lomo updates inside backward" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["guard.enabled=true", "train.grad_accum=2"])
    assert "needs train.grad_accum 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["guard.enabled=true", "guard.on_spike=pause", "control.enabled=false"])
    assert "guard.on_spike: rewind and pause act through the control plane" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["guard.on_grad_norm=skip"])
    assert "guard.on_grad_norm: must be one of 'rewind', 'pause'" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["guard.enabled=true", "guard.snapshot_every_n_steps=2", "checkpoint.snapshots_keep=0"])
    assert "guard.snapshot_every_n_steps: snapshots are off" in str(e.value)
    # what does work: rewind with accumulation; skip alone without the control plane; off = no checks
    load_config(overrides=["guard.enabled=true", "train.grad_accum=2", "guard.on_nonfinite=rewind",
                           "guard.on_spike=rewind"])
    load_config(overrides=["guard.enabled=true", "control.enabled=false"])
    load_config(overrides=["method=lomo", "guard.on_spike=skip"])


# -- the guard in a 2-rank DeepSpeed run -----------------------------------------------------------

def _events(folder: str) -> list[dict]:
    return [json.loads(line) for line in (Path(folder) / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("guard")
    results = parse_results(run_deepspeed(SCRIPTS / "guard_check.py", nproc=2, args=("--out", str(out)),
                                          timeout=420))
    by_scenario: dict[str, list[dict]] = {}
    for r in results:
        by_scenario.setdefault(r["scenario"], []).append(r)
    for name, ranks in by_scenario.items():  # every rank took the same decisions
        assert len(ranks) == 2, name
        assert ranks[0]["seen"] == ranks[1]["seen"] and ranks[0]["optimizer_steps"] == ranks[1]["optimizer_steps"]
    return {name: {**ranks[0], "events": _events(ranks[0]["folder"])} for name, ranks in by_scenario.items()}


@pytest.mark.slow
def test_poisoned_batches_lora_skip_then_pause_at_the_cap(launched):
    run = launched["skip"]
    events = run["events"]
    assert [s for s, _ in run["seen"]] == list(range(1, 13))
    assert run["optimizer_steps"] == 10  # steps 7 and 8 were neither back-propagated nor applied
    guards = [e for e in events if e["type"] == "guard"]
    assert [(e["step"], e["trigger"], e["action"], e["update_applied"]) for e in guards] == [
        (7, "loss_spike", "skip", False), (8, "loss_spike", "pause", False)]
    assert "guard.max_skips_in_a_row 1" in guards[1]["reason"]
    states = [(e["state"], e["step"]) for e in events if e["type"] == "state"]
    assert ("paused", 8) in states and states.index(("paused", 8)) + 1 == states.index(("running", 8))
    train = {e["step"]: e for e in events if e["type"] == "train"}
    assert train[7]["loss"] > guards[0]["threshold"]
    # the schedule did not advance through the two steps that applied nothing
    assert train[7]["lr"] == train[8]["lr"] == train[9]["lr"] > train[10]["lr"]
    # recovered: every later loss is back where it was before the poison (within 2%)
    assert all(train[s]["loss"] < 1.02 * train[6]["loss"] for s in (9, 10, 11, 12))
    # the norm the guard reads (DeepSpeed's, ZeRO 2) is there for every applied step
    applied = [n for i, n in enumerate(run["norms"]) if i + 1 not in (7, 8)]
    assert all(n is not None and 0 < n < math.inf for n in applied)


@pytest.mark.slow
def test_set_lr_far_too_high_guard_rewinds_to_its_snapshot_with_the_lr_halved(launched):
    run = launched["rewind"]
    events = run["events"]
    steps = [s for s, _ in run["seen"]]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9, 10, 11, 12]
    assert run["optimizer_steps"] == 12  # 6 restored with the snapshot, 6 after; the spike's not applied
    kinds = [e["type"] for e in events]
    g = kinds.index("guard")
    guard, rewind, scaled = events[g], events[g + 1], events[g + 2]
    assert (guard["step"], guard["trigger"], guard["action"], guard["update_applied"]) == (8, "loss_spike", "rewind", False)
    assert (guard["target"], guard["target_step"], guard["rewinds"]) == ("snapshot:guard-6", 6, 1)
    assert (rewind["type"], rewind["step"], rewind["abandoned"], rewind["reason"]) == ("rewind", 6, [7, 8], "guard: loss_spike")
    assert (scaled["type"], scaled["changes"], scaled["before"]) == ("set", {"lr_scale": 0.5}, {"lr_scale": 1.0})
    too_high = next(e for e in events if e["type"] == "set" and "lr" in e["changes"])
    train = [e for e in events if e["type"] == "train"]
    first, second = train[:8], train[8:]
    assert first[6]["lr"] == 1.0 and first[7]["loss"] > 5 * first[5]["loss"]  # the spike
    # step 7 again: the same weights and batch (the same loss), the schedule's rate halved
    assert second[0]["step"] == 7 and second[0]["loss"] == first[6]["loss"]
    assert second[0]["lr"] == pytest.approx(0.5 * too_high["before"]["lr"])
    assert all(e["loss"] < first[5]["loss"] for e in second[1:])  # recovered: below step 6's loss
    assert [e["type"] for e in events].count("guard") == 1
    # ZeRO 0 in fp32 keeps no norm of DeepSpeed's: the gate measured it before each update
    assert all(n is not None and 0 < n < math.inf for i, n in enumerate(run["norms"]) if i != 7)


@pytest.mark.slow
def test_with_accumulation_the_guard_judges_after_the_update_and_rewinds_from_disk(launched):
    run = launched["accum"]
    events = run["events"]
    assert [s for s, _ in run["seen"]] == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9, 10, 11, 12]
    guard = next(e for e in events if e["type"] == "guard")
    assert (guard["step"], guard["trigger"], guard["action"]) == (8, "loss_spike", "rewind")
    assert guard["update_applied"] is True  # two micro-batches: judged once the update was applied
    assert (guard["target"], guard["target_step"]) == ("6", 6)  # the checkpoint step-6, on disk
    rewind = events[events.index(guard) + 1]
    assert rewind["type"] == "rewind" and rewind["source"].endswith("checkpoints/step-6")
    assert rewind["abandoned"] == [7, 8] and rewind["reason"] == "guard: loss_spike"
    train = [e for e in events if e["type"] == "train"]
    assert train[8]["step"] == 7 and train[8]["loss"] == train[6]["loss"]  # step 7 again, exactly
    too_high = next(e for e in events if e["type"] == "set" and "lr" in e["changes"])
    assert train[8]["lr"] == pytest.approx(0.5 * too_high["before"]["lr"])  # the schedule's rate, halved
    assert all(e["loss"] < train[5]["loss"] for e in train[9:])  # recovered: below step 6's loss
    assert run["norms"][7] > 5 * max(run["norms"][:7])  # the spiked step's own norm, read after its update
