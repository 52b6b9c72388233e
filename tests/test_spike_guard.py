"""The spike guard: its decisions on plain numbers (engine.spike_guard, no torch), its config
checks, and one 2-rank DeepSpeed launch where injected trouble meets each action
(tests/scripts/guard_check.py):

    lora, ZeRO 2    poisoned micro-batches at steps 7 and 8: step 7 is skipped before its
                    backward (DeepSpeed's optimizer steps one fewer time), step 8 reaches the
                    cap of skips in a row and pauses; a resume sent earlier lets it go on
    full, ZeRO 0    a live `set lr` far too high after step 6: step 8's loss spikes, the guard
                    rewinds to its snapshot of step 6 with the lr halved, and the run recovers
"""

from __future__ import annotations

import math

import pytest

from contract.config import ConfigError, GuardConfig, load_config
from engine.spike_guard import SpikeGuard, SpikeStatistic, Verdict, newest_good


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
    assert "2 steps in a row were skipped already (guard.max_skips_in_a_row 2)" in verdicts[-1].reason
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
    e = Verdict("skip", "nonfinite_loss", "nan", math.nan, None).event(7, rewinds=0)
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
    assert "guard.on_grad_norm: expected one of 'rewind', 'pause'" in str(e.value)
    # what does work: rewind with accumulation; skip alone without the control plane; off = no checks
    load_config(overrides=["guard.enabled=true", "train.grad_accum=2", "guard.on_nonfinite=rewind",
                           "guard.on_spike=rewind"])
    load_config(overrides=["guard.enabled=true", "control.enabled=false"])
    load_config(overrides=["method=lomo", "guard.on_spike=skip"])
