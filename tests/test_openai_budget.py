"""The serving budget holds over every window of 10 s or more, not only on average since the
start: a run's boundaries simulated on a clock of our own (no wall time), with requests waiting at
every boundary after a quiet spell (the case where a saved-up bucket let a burst through)."""

from __future__ import annotations

import pytest

from engine.control.serving import WINDOW_S, ServingBudget

SHARE = 0.05


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sustained(budget: ServingBudget, clock: Clock, quiet_s: float, seconds: float, step_s: float,
               cost_s: float) -> list[tuple[float, float]]:
    """(start, seconds) of every boundary that answered, under requests that never stop coming;
    each step takes `step_s`, each answering boundary `cost_s` more (both of wall time)."""
    budget.begin()
    clock.now += quiet_s  # the run trains with nobody asking
    served, end = [], clock.now + seconds
    while clock.now < end:
        if budget.allows():
            served.append((clock.now, cost_s))
            clock.now += cost_s
            budget.charge(cost_s)
        else:
            budget.held += 1
        clock.now += step_s
    return served


def _worst_share(served: list[tuple[float, float]], window_s: float, start: float, end: float) -> float:
    """The largest share of any window of `window_s` within start..end that serving took."""
    worst = 0.0
    for t0 in [start] + [t for t, _ in served]:
        if t0 + window_s > end:
            break
        worst = max(worst, sum(s for t, s in served if t0 <= t < t0 + window_s) / window_s)
    return worst


@pytest.mark.parametrize("cost_s", [0.002, 0.02, 0.1])
def test_every_window_of_ten_seconds_or_more_keeps_the_share(cost_s):
    clock = Clock()
    budget = ServingBudget(SHARE, clock=clock)
    served = _sustained(budget, clock, quiet_s=120.0, seconds=120.0, step_s=0.05, cost_s=cost_s)
    start, end = served[0][0], clock.now
    for window in (WINDOW_S, 15.0, 20.0, 60.0):
        # one boundary answered whole before it was paid back is all it may go over
        assert _worst_share(served, window, start, end) <= SHARE + cost_s / window + 1e-9, window
    total = sum(s for _, s in served) / (end - start)
    every_boundary = cost_s / (cost_s + 0.05)  # cheap requests answered at every boundary take less
    assert 0.9 * min(SHARE, every_boundary) <= total <= SHARE + cost_s / (end - start) + 1e-9
    assert (budget.held > 0) == (cost_s > 0.05 * SHARE) and budget.snapshot()["largest_s"] == cost_s


def test_a_boundary_answers_once_what_it_served_is_paid_back():
    clock = Clock()
    budget = ServingBudget(0.1, clock=clock)
    budget.begin()
    assert budget.allows()       # nothing owed: the first requests are answered at once
    budget.charge(0.5)           # 0.5 s owed: paid back in 5 s of wall time
    clock.now += 4.9
    assert not budget.allows() and budget.wait_s() == pytest.approx(0.1)
    clock.now += 0.1
    assert budget.allows() and budget.wait_s() == 0
    clock.now += 600.0           # a quiet spell saves nothing up
    budget.charge(0.2)
    assert not budget.allows() and budget.snapshot()["wait_s"] == pytest.approx(2.0)
    assert ServingBudget(1.0, clock=clock).allows() and not ServingBudget(0.0, clock=clock).allows()
