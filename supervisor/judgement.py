"""The failure judgement: which rank died or hangs, and why. A pure function of observed facts.

`RunHandle` gathers the facts (the event log's summary, the process group as last seen, the
exits it saw and how, what the launcher and the rank logs said, the clock) into `Facts`; `judge`
says what they mean as a `Verdict`, and `Verdict.message` words it with the last lines of the log
it points at. Nothing here reads a file, a process or the clock, so every case is a row in a
table (tests/test_supervisor_judgement.py).

How a culprit is told apart from its victims, whatever order the evidence arrives in. When one
rank dies, the others fail after it: a lost-peer error of their own, or the launcher's SIGTERM.
So among the ranks that failed, the first one seen is the culprit; ranks seen gone in the same
look are told apart by the evidence of how each ended (`evidence`, strongest first):

  0  ended by a signal that no launcher sends (SIGKILL of the OOM killer or a user, SIGSEGV):
     read from its zombie, or from the launcher's report of the first rank it saw fail
     (`Facts.launcher_status`, attributed to the one rank that could have ended so);
  1  ended with its own error (an exit code seen, or an exception in its log);
  2  vanished unseen (its launcher reaped it first) without a word in its log;
  3  a victim: ended by SIGTERM / SIGINT, or its last error is a lost connection to a peer.

A run that reports its own failure (rank 0's `failed` event) is judged the same way: a rank
with stronger evidence than the reporter's own error is the cause, at once; otherwise the verdict
waits until the group is gone (its launcher ends it within seconds of a failure), because only
then is every exit and the launcher's report in. It is not a race against a fixed wait: on a
slower machine the group takes longer to go and the verdict waits as long.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, replace
from enum import Enum
from typing import Sequence

from contract.protocol.states import RunState

from supervisor.procs import describe_returncode, describe_status, failed_status

# A rank that vanished unseen (exit status unknown) while the others go on is called dead after
# this long, unless the launcher logged it as a clean exit: a clean early exit of one rank is
# followed by the run's own final state well before then in practice.
UNSEEN_EXIT_GRACE_S = 5.0
# Ranks going on without their launcher this long are orphans (not a group being torn down).
LAUNCHER_GRACE_S = 2.0
# A run that wrote its final state and still has processes this much later is stuck on the way
# out (a hung teardown): the rest of its group is ended. A run that reported its own failure is
# judged then with what is known, if its group has not gone by itself before (it normally goes
# within seconds: the verdict waits for that, not for this bound).
LINGER_GRACE_S = 30.0
# Exits seen within this of each other came from one look: who went first is decided by the
# evidence of how each ended. (A look stamps every exit it finds with one time; this only
# covers exits reported one by one from one wake-up.)
SAME_WAKE_S = 0.05

# What a rank whose peer died says of it (gloo, NCCL, torch.distributed): a victim's error.
LOST_PEER = re.compile(r"connection (reset|closed|refused)|broken pipe|socket closed|remote process exited|"
                       r"communicator was aborted|DistNetworkError|peer (closed|disconnected)|"
                       r"timed out waiting .* for (recv|send)|early EOF", re.IGNORECASE)


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
    # the launcher's report of the first rank it saw fail (a wait status; DeepSpeed's launcher
    # does not say which rank), and the pid when it does say (torchrun)
    launcher_status: int | None = None
    launcher_pid: int | None = None
    raised: frozenset[int] = frozenset()     # ranks whose log ends in an exception
    lost_peer: frozenset[int] = frozenset()  # ... whose last exception is a lost connection to a peer


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
            if LOST_PEER.search(exception):  # a victim's view of a death: no cause of its own
                return f"{self.reason}; last error: {exception}"
            return f"{exception}; {self.reason}"  # the cause first
        return self.reason + self.suffix


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b(:.*)?$")


def last_exception(lines: Sequence[str]) -> str | None:
    """The last `SomeError: message` line of a traceback in a log tail, with the indented lines
    that continue its message (a ConfigError lists its problems so), worded cause first."""
    for at in range(len(lines) - 1, -1, -1):
        if _EXCEPTION_LINE.match(lines[at].strip()):
            more = []
            for line in lines[at + 1:]:
                if not line.startswith((" ", "\t")) or not line.strip():
                    break
                more.append(line)
            return cause_first("\n".join([lines[at].strip(), *more]))
    return None


def cause_first(text: str) -> str:
    """An error whose first line only announces what follows ("ConfigError: invalid run config
    (1 problem):", then "  - data.train: no such file or folder") on one line, the cause first:
    "data.train: no such file or folder (ConfigError: invalid run config, 1 problem)". Any other
    text comes back unchanged."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if len(lines) < 2 or not lines[0].endswith(":"):
        return text
    causes = "; ".join(ln[2:] if ln.startswith("- ") else ln for ln in lines[1:])
    header = re.sub(r" \((\d+ problems?)\):$", r", \1", lines[0]).rstrip(":")
    return f"{causes} ({header})"


def killed_by_signal(status: int | None) -> bool:
    """Ended by a signal that no launcher sends to end the others (SIGKILL, SIGSEGV, SIGABRT ...).
    (A launcher SIGKILLs a rank only after it ignored SIGTERM for long: seen much later.)"""
    return (status is not None and os.WIFSIGNALED(status)
            and os.WTERMSIG(status) not in (signal.SIGTERM, signal.SIGINT))


def evidence(e: RankExit, f: Facts) -> int:
    """How strongly this exit points at the cause of the failure: 0 strongest, 3 a victim (the
    classes are listed in the module's docstring)."""
    if killed_by_signal(e.status):
        return 0
    if e.rank in f.lost_peer or (e.status is not None and os.WIFSIGNALED(e.status)):
        return 3
    if e.status is not None or e.rank in f.raised:
        return 1
    return 2


def reporter_evidence(f: Facts) -> int:
    """The evidence class of the run's own failure report: a victim when it is a lost peer."""
    return 3 if f.error is not None and LOST_PEER.search(f.error) else 1


def attributed(f: Facts) -> tuple[RankExit, ...]:
    """The exits, with the launcher's report of a death by signal given to the one rank it can
    be: named by pid (torchrun), else the only rank seen gone with no exit status, no exception
    in its log, and not the rank that reported the run's failure (it lived to report)."""
    if not killed_by_signal(f.launcher_status) or any(killed_by_signal(e.status) for e in f.exits):
        return f.exits
    candidates = [e for e in f.exits if not e.host and e.status is None and (
        e.pid == f.launcher_pid if f.launcher_pid is not None else
        e.rank not in f.raised and not (f.state == RunState.FAILED and e.rank == f.error_rank))]
    if len(candidates) != 1:
        return f.exits
    return tuple(replace(e, status=f.launcher_status) if e is candidates[0] else e for e in f.exits)


def culprit(f: Facts, exits: Sequence[RankExit] | None = None) -> RankExit | None:
    """The rank that failed first (of `exits`, default the facts' own, with the launcher's report
    attributed): the first seen, and among those seen in one look the one with the strongest
    evidence. None when no rank failed or the first cannot be told apart."""
    exits = attributed(f) if exits is None else exits
    bad = [e for e in exits if failed_status(e.status) and not (e.status is None and e.pid in f.clean_pids)]
    if not bad:
        return None
    first = min(e.seen for e in bad)
    tied = [e for e in bad if e.seen - first < SAME_WAKE_S]
    best = min(evidence(e, f) for e in tied)
    strongest = [e for e in tied if evidence(e, f) == best]
    return strongest[0] if len(strongest) == 1 else None


def _rank_died(who: RankExit, prefix: str = "", suffix: str = "") -> Verdict:
    kind = VerdictKind.EXITED if prefix else VerdictKind.RANK_DIED
    where = f" on host {who.host}" if who.host else ""
    reason = f"{prefix}rank {who.rank}{where} (pid {who.pid}) ended with {describe_status(who.status)}"
    return Verdict(kind, who.rank, reason, who, uses_log="rank", suffix=suffix)


def exited(f: Facts) -> Verdict:
    """The failure of a group that is gone without having written a final state."""
    who = culprit(f)
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
    who = culprit(f)
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


def post_mortem(f: Facts) -> Verdict | None:
    """The judgement of a run whose group is gone, looked at now whether or not this process saw
    it alive: what a listing or a report after the end shows."""
    return judge(replace(f, alive=False, launcher_alive=False, seen_alive=True, stopping=False))


def _killed_elsewhere(f: Facts) -> RankExit | None:
    """A rank on another machine killed by a signal (not a launcher's SIGTERM / SIGINT), other
    than the rank that reported the failure: it could report nothing, and the run's own error
    (a lost connection to a peer) is its consequence. Ranks that exited with a code are not
    blamed over the run's own report: their launcher's poll (each second) decides when they
    show, not when they failed."""
    for e in f.exits:
        if e.host and e.rank != f.error_rank and killed_by_signal(e.status):
            return e
    return None


def _failed_first(f: Facts) -> RankExit | None:
    """The rank that failed before the run reported its failure, if the evidence says one did:
    stronger evidence than the reporter's own error (a lost peer is the weakest)."""
    who = culprit(f, tuple(e for e in attributed(f) if not e.host))
    if who is not None and who.rank != f.error_rank and evidence(who, f) < reporter_evidence(f):
        return who
    return _killed_elsewhere(f)


def _judge_final(f: Facts) -> Verdict | None:
    if f.state == RunState.FAILED and f.seen_alive:
        who = _failed_first(f)
        if who is not None:
            # a rank died first; what the run reported is the others' view of that death
            return _rank_died(who, suffix=f"; the run then reported: {f.error}")
        if f.alive and f.launcher_alive and (f.final_since is None or f.now - f.final_since < LINGER_GRACE_S):
            return None  # every exit and the launcher's report are in once the group is gone
        return Verdict(VerdictKind.ERROR, f.error_rank, f.error or str(RunState.FAILED))
    if f.alive and f.final_since is not None and f.now - f.final_since > LINGER_GRACE_S:
        return Verdict(VerdictKind.LINGERING, None, "the run wrote its final state "
                       f"{f.now - f.final_since:.0f} s ago and some of its processes are still there")
    return None
