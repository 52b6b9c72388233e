"""The spike guard's decisions, pure: fed losses and gradient norms, it answers with actions.

No torch here (tests/test_spike_guard.py drives it with plain numbers); engine.guard.hook runs
it inside the training loop and carries the actions out. Every rank runs its own copy on the
same inputs (the loss reduced over the ranks, then made equal everywhere by one all-reduce), so
every rank takes the same decision and no collective is entered by some ranks only.

Triggers and their actions (the `guard` config section, contract.config.schema.GuardConfig):

    nonfinite_loss        the step's loss is NaN or inf                      on_nonfinite
    loss_spike            the loss is above the running statistic's bound     on_spike
    grad_norm             the global gradient norm is above grad_norm_max     on_grad_norm
    nonfinite_grad_norm   the gradient norm is NaN or inf                     on_grad_norm

The spike statistic is robust, over the losses of the last `window` accepted steps: their
median, and their noise sigma = 1.4826 x the median of |step-to-step change| / sqrt(2) (the
standard deviation of normal noise, estimated from successive differences so that the trend of
a falling loss is not taken for noise). A loss spikes when it is above

    max(median + spike_z * sigma,  spike_ratio * median)

Medians, unlike means and standard deviations, are not dragged up by the very spikes they are
meant to catch; a falling loss only lowers the median, so it never reads as a spike (the median
lags a little behind it, which errs on the side of calling nothing). The ratio term keeps a
nearly noise-free loss (a tiny sigma) from turning every wiggle into a spike. Spikes
are judged only after `warmup_steps` accepted steps (the early loss falls too fast to have a
meaningful statistic); non-finite values and the norm bound are judged from step 1.

Only accepted steps enter the window: a skipped step's loss, or the loss that triggered a
rewind, never raises the bound. The caps: a skip after `max_skips_in_a_row` skips in a row
pauses instead, and a rewind once `max_rewinds` rewinds are spent pauses instead; the reason
says so. The guard's counters are not part of training checkpoints: a rewind must not give
back the rewinds it spent (that is what would let a run loop forever).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from contract.config.schema import GuardConfig
from contract.events import GuardEvent

MAD_TO_STD = 1.4826  # the median absolute deviation of normal noise times this is its standard deviation
OK = "ok"


@dataclass(frozen=True)
class Verdict:
    """What the guard decided about one step: `action` is "ok", "skip", "rewind" or "pause";
    the rest says why (the `guard` event's fields)."""
    action: str = OK
    trigger: str = ""
    reason: str = ""
    value: float | None = None
    threshold: float | None = None

    @property
    def ok(self) -> bool:
        return self.action == OK

    def event(self, step: int, **extra) -> GuardEvent:
        """The `guard` event of this verdict."""
        return GuardEvent(step=step, trigger=self.trigger, action=self.action, reason=self.reason,
                          value=_plain(self.value), threshold=_plain(self.threshold), **extra)


class SpikeStatistic:
    """Median and noise of the last `window` accepted losses, and the spike bound they give."""

    def __init__(self, window: int):
        self.losses: deque[float] = deque(maxlen=window)

    def add(self, loss: float) -> None:
        self.losses.append(float(loss))

    def bound(self, z: float, ratio: float) -> float | None:
        """The loss above which a step spikes; None while fewer than 3 losses are known."""
        if len(self.losses) < 3:
            return None
        median = statistics.median(self.losses)
        return max(median + z * self.sigma(), ratio * median)

    def sigma(self) -> float:
        """The noise's standard deviation, from the median step-to-step change."""
        values = list(self.losses)
        changes = [abs(b - a) for a, b in zip(values, values[1:])]
        return MAD_TO_STD * statistics.median(changes) / math.sqrt(2) if changes else 0.0

    def describe(self) -> str:
        return f"the median {statistics.median(self.losses):.4g} of the last {len(self.losses)} accepted steps"


class SpikeGuard:
    """The decisions of one run's guard (every rank keeps an identical one)."""

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.stat = SpikeStatistic(cfg.window)
        self.accepted = 0          # steps accepted so far (the warm-up counts these)
        self.rewinds = 0           # guard rewinds done (capped by max_rewinds)
        self.skips_in_a_row = 0

    # -- judging ------------------------------------------------------------------------------------
    def judge_loss(self, loss: float) -> Verdict:
        """The loss of a step (before its update when the step lets the guard in first)."""
        cfg = self.cfg
        if not math.isfinite(loss):
            return self._act("nonfinite_loss", cfg.on_nonfinite, f"the loss is {loss}", loss, None)
        bound = self.stat.bound(cfg.spike_z, cfg.spike_ratio) if self.accepted >= cfg.warmup_steps else None
        if bound is not None and loss > bound:
            reason = (f"the loss {loss:.4g} is above the spike bound {bound:.4g} ({self.stat.describe()}; "
                      f"spike_z {cfg.spike_z:g}, spike_ratio {cfg.spike_ratio:g})")
            return self._act("loss_spike", cfg.on_spike, reason, loss, bound)
        return Verdict()

    def judge_grad_norm(self, norm: float | None) -> Verdict:
        """The global gradient norm of a step (None: the step measured none)."""
        if norm is None:
            return Verdict()
        if not math.isfinite(norm):
            return self._act("nonfinite_grad_norm", self.cfg.on_grad_norm,
                             f"the gradient norm is {norm}", norm, None)
        bound = self.cfg.grad_norm_max
        if bound > 0 and norm > bound:
            return self._act("grad_norm", self.cfg.on_grad_norm,
                             f"the gradient norm {norm:.4g} is above guard.grad_norm_max {bound:g}", norm, bound)
        return Verdict()

    def _act(self, trigger: str, action: str, reason: str, value: float | None,
             threshold: float | None) -> Verdict:
        """The configured action, or pause where its cap is reached."""
        cfg = self.cfg
        if action == "skip" and self.skips_in_a_row >= cfg.max_skips_in_a_row:
            n = self.skips_in_a_row
            action, reason = "pause", (f"{reason}; {n} step{'s' * (n != 1)} in a row skipped already "
                                       f"(guard.max_skips_in_a_row {cfg.max_skips_in_a_row}), so it pauses")
        elif action == "rewind" and self.rewinds >= cfg.max_rewinds:
            action, reason = "pause", (f"{reason}; the guard has rewound {self.rewinds} times "
                                       f"(guard.max_rewinds {cfg.max_rewinds}), so it pauses")
        return Verdict(action, trigger, reason, value, threshold)

    # -- what a step's verdict leaves behind --------------------------------------------------------
    def settle(self, loss: float, verdict: Verdict) -> None:
        """Record the outcome of a step: an accepted step's loss enters the statistic; skips
        in a row and rewinds are counted."""
        if verdict.ok:
            self.stat.add(loss)
            self.accepted += 1
            self.skips_in_a_row = 0
        elif verdict.action == "skip":
            self.skips_in_a_row += 1
        else:
            self.skips_in_a_row = 0
            if verdict.action == "rewind":
                self.rewinds += 1

    def fallback(self, verdict: Verdict, why: str) -> Verdict:
        """A rewind that cannot happen (nothing to rewind to) pauses instead, saying why."""
        return Verdict("pause", verdict.trigger, f"{verdict.reason}; {why}, so it pauses",
                       verdict.value, verdict.threshold)


def newest_good(candidates: Iterable[tuple[str, int]], trigger_step: int) -> tuple[str, int] | None:
    """The rewind target: the newest (name, step) at step `trigger_step` - 2 or before.

    A step's loss is computed with the weights the step before it left, so a spike at step s
    already puts the state after step s - 1 under suspicion (an lr far too high breaks the
    weights in step s - 1's update, and shows in step s's loss). Among equal steps the last
    candidate wins (callers list checkpoints first, then snapshots: snapshots load faster).
    """
    best: tuple[str, int] | None = None
    for name, step in candidates:
        if step <= trigger_step - 2 and (best is None or step >= best[1]):
            best = (name, step)
    return best


def _plain(x: float | None) -> float | str | None:
    """A number as JSON can carry it (NaN and inf as strings)."""
    if x is None:
        return None
    return float(x) if math.isfinite(x) else str(x)
