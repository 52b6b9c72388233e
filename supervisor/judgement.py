"""The failure judgement: which rank died or hangs, and why. A pure function of observed facts.

`RunHandle` gathers the facts (the event log's summary, the process group as last seen, the
exits it saw and how, the clock) into `Facts`; `judge` says what they mean as a `Verdict`, and
`Verdict.message` words it with the last lines of the log it points at. Nothing here reads a
file, a process or the clock, so every case is a row in a table (tests/test_supervisor_judgement.py).

How a culprit is told apart from its victims: when one rank dies, the launcher ends the others
with SIGTERM. So among the ranks that failed, the first one seen is the culprit; exits seen
within one wake-up (SAME_WAKE_S) are told apart by how they ended: not by SIGTERM, and with a
known exit status, is the cause.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from contract.protocol import RunState

from supervisor.procs import describe_returncode, describe_status, ended_by_sigterm, failed_status

# A rank that vanished unseen (exit status unknown) while the others go on is called dead after
# this long, unless the launcher logged it as a clean exit: a clean early exit of one rank is
# followed by the run's own final state well before then in practice.
UNSEEN_EXIT_GRACE_S = 5.0
# Ranks going on without their launcher this long are orphans (not a group being torn down).
LAUNCHER_GRACE_S = 2.0
# A run that wrote its final state and still has processes this much later is stuck on the way
# out (a hung teardown): the rest of its group is ended.
LINGER_GRACE_S = 30.0
# Exits this close together came from one wake-up: who went first is decided by how they ended.
SAME_WAKE_S = 0.05
# A failure the run reports itself waits this long (while the launcher runs) for a rank's death
# to be seen, which the run's error is then only the consequence of: a rank killed here is seen
# by the next look (its exit can be read after the run's "failed" event: rank 0's lost-peer
# error is written at once), one on another machine when its launcher's poll (each second)
# reports it through pdsh.
REPORT_GRACE_S = 5.0


class VerdictKind(str, Enum):
    """What is wrong with a run (the `kind` of a `Failure`)."""
    RANK_DIED = "rank_died"          # a rank ended while the run was going, or before its report
    LAUNCHER_DIED = "launcher_died"  # the launcher is gone and ranks go on without it
    EXITED = "exited"                # the whole group is gone without a final state
    ERROR = "error"                  # the run reported its own failure
    HUNG = "hung"                    # alive, running, and no progress for too long
    LINGERING = "lingering"          # over by its own account, yet processes of it remain


@dataclass(frozen=True)
class RankExit:
    """A rank seen gone: its pid, its wait status if anyone read it, and when (monotonic s);
    `host`: the machine it ran on, when not this one (reported by its launcher: supervisor.remote)."""
    rank: int
    pid: int | None
    status: int | None
    seen: float
    host: str = ""


@dataclass(frozen=True)
class Facts:
    """What was observed about one run at one moment (`now`, monotonic seconds)."""
    now: float
    state: RunState | None = None        # the event log's last state
    step: int = 0
    error: str | None = None             # the run's own `failed` event: its reason and rank
    error_rank: int | None = None
    events: int = 0                      # events read so far
    pid: int | None = None               # the launcher's pid (= the group id)
    alive: bool = False                  # some process of the group is running
    seen_alive: bool = False             # ... was, at least once, while we looked
    stopping: bool = False               # a stop is in progress (ours or another process's)
    launcher_alive: bool = False
    launcher_gone_since: float | None = None  # when the launcher was first seen gone, ranks alive
    launcher_code: int | None = None     # its return code, when this process started it
    ranks_seen: int = 0                  # rank processes seen so far
    exits: tuple[RankExit, ...] = ()     # ranks seen gone
    clean_pids: frozenset[int] = frozenset()  # pids the launcher logged as exiting cleanly
    last_progress: float = 0.0           # when the training loop last showed progress (heartbeat)
    hang_timeout: float = 300.0
    final_since: float | None = None     # when the final state was first seen with the group alive
    remote: bool = False                 # the run's ranks were started on several machines


@dataclass(frozen=True)
class Verdict:
    """The judgement: what kind of trouble, which rank (None: not one rank), and the words."""
    kind: VerdictKind
    rank: int | None
    reason: str                          # the message before anything taken from a log
    culprit: RankExit | None = None
    # how log lines complete the reason: "rank" (the culprit's exception in brackets), "last"
    # (the last error of every log, appended), or "" (nothing)
    uses_log: str = ""
    suffix: str = ""                     # words after the culprit's description

    def message(self, lines: Sequence[str]) -> str:
        """The reason, completed with what `lines` (the tail of the log `rank` points at, or of
        every log for no rank) say: the last exception of a traceback."""
        exception = last_exception(lines)
        if self.uses_log == "rank" and exception:
            return f"{self.reason} ({exception}){self.suffix}"
        if self.uses_log == "last" and exception:
            return f"{self.reason}; last error: {exception}"
        return self.reason + self.suffix


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b(:.*)?$")


def last_exception(lines: Sequence[str]) -> str | None:
    """The last `SomeError: message` line of a traceback in a log tail."""
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line.strip()):
            return line.strip()
    return None


def culprit(exits: Sequence[RankExit], clean_pids: frozenset[int] = frozenset()) -> RankExit | None:
    """The rank that died first and not as a victim of the launcher ending the others; None when
    no rank failed or the first failures cannot be told apart."""
    bad = [e for e in exits if failed_status(e.status) and not (e.status is None and e.pid in clean_pids)]
    if not bad:
        return None
    first = min(e.seen for e in bad)
    tied = [e for e in bad if e.seen - first < SAME_WAKE_S]
    if len(tied) == 1:
        return tied[0]
    causes = [e for e in tied if not ended_by_sigterm(e.status)]
    seen = [e for e in causes if e.status is not None]
    for group in (seen, causes):
        if len(group) == 1:
            return group[0]
    return None


def _rank_died(who: RankExit, prefix: str = "", suffix: str = "") -> Verdict:
    kind = VerdictKind.EXITED if prefix else VerdictKind.RANK_DIED
    where = f" on host {who.host}" if who.host else ""
    reason = f"{prefix}rank {who.rank}{where} (pid {who.pid}) ended with {describe_status(who.status)}"
    return Verdict(kind, who.rank, reason, who, uses_log="rank", suffix=suffix)


def exited(f: Facts) -> Verdict:
    """The failure of a group that is gone without having written a final state."""
    who = culprit(f.exits, f.clean_pids)
    if who is not None:
        return _rank_died(who, prefix="exited without a final state: ")
    reason = "exited without a final state"
    if f.launcher_code is not None:
        reason += f" (launcher ended with {describe_returncode(f.launcher_code)})"
    elif not f.events and f.pid is None:
        reason = "never started (no launcher pid and no event)"
    return Verdict(VerdictKind.EXITED, None, reason, uses_log="last")


def judge(f: Facts) -> Verdict | None:
    """What the facts say is wrong with the run, or None when nothing is (or it is being
    stopped: a stop ends the group on purpose)."""
    if f.stopping:
        return None
    if f.state is not None and f.state.final:
        return _judge_final(f)
    if not f.alive:
        return exited(f) if f.seen_alive else None
    who = culprit(f.exits, f.clean_pids)
    if who is not None and (who.status is not None or f.now - who.seen > UNSEEN_EXIT_GRACE_S):
        return _rank_died(who)
    if (not f.launcher_alive and f.launcher_gone_since is not None and f.ranks_seen
            and f.now - f.launcher_gone_since > LAUNCHER_GRACE_S):
        return Verdict(VerdictKind.LAUNCHER_DIED, None,
                       f"the launcher (pid {f.pid}) ended while ranks were still running")
    stalled = f.now - f.last_progress
    if f.state == RunState.RUNNING and stalled > f.hang_timeout:
        return Verdict(VerdictKind.HUNG, None, f"no training progress for {stalled:.0f} s while "
                       f"running (last step {f.step}; hang timeout {f.hang_timeout:g} s)")
    return None


def _killed_elsewhere(f: Facts) -> RankExit | None:
    """A rank on another machine killed by a signal (not a launcher's SIGTERM / SIGINT), other
    than the rank that reported the failure: it could report nothing, and the run's own error
    (a lost connection to a peer) is its consequence. Ranks that exited with a code are not
    blamed over the run's own report."""
    for e in f.exits:
        if (e.host and e.rank != f.error_rank and e.status is not None and os.WIFSIGNALED(e.status)
                and os.WTERMSIG(e.status) not in (signal.SIGTERM, signal.SIGINT)):
            return e
    return None


def _judge_final(f: Facts) -> Verdict | None:
    if f.state == RunState.FAILED and f.seen_alive:
        # a remote rank's exit code is not blamed over the run's report: its launcher's poll
        # (each second) decides when it shows, not when the rank failed
        who = culprit(tuple(e for e in f.exits if not e.host), f.clean_pids)
        if who is None or who.rank == f.error_rank:
            who = _killed_elsewhere(f) or who
        if ((who is None or who.rank == f.error_rank) and f.alive and f.launcher_alive
                and (f.final_since is None or f.now - f.final_since < REPORT_GRACE_S)):
            return None  # the rank that died first may not be seen yet (here, or by its launcher)
        if who is not None and who.rank != f.error_rank:
            # a rank died first; what the run reported is the others' view of that death
            return _rank_died(who, suffix=f"; the run then reported: {f.error}")
        return Verdict(VerdictKind.ERROR, f.error_rank, f.error or "failed")
    if f.alive and f.final_since is not None and f.now - f.final_since > LINGER_GRACE_S:
        return Verdict(VerdictKind.LINGERING, None, "the run wrote its final state "
                       f"{f.now - f.final_since:.0f} s ago and some of its processes are still there")
    return None
