"""One run: its folder, its process group, its state, and how it is stopped or found broken.

A run's state comes from two places: its event log (what the run said) and its process group
(whether it is still there). A group gone without a final state event is a failed run ("exited
without a final state"). Dead ranks are told apart from their victims by the order they died in
and by how: the launcher ends the survivors with SIGTERM, the rank that went first did not.
"""

from __future__ import annotations

import fcntl
import threading
import time

from contract.run_folder import EventLog, EventTail, RunFolder

from supervisor import procs, stopping
from supervisor.records import (Failure, RankExit, RunInfo, child_running, last_exception,
                              launcher_reported_success, log_tail, mark_stopping, read_pid, reap,
                              stop_in_progress)
from supervisor.summary import RunSummary

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


class RunHandle:
    """A run in the manager's output folder. Thread-safe; every method may be called from any
    thread. Built by `RunManager`; `refresh` is what brings it up to date."""

    def __init__(self, folder: RunFolder, hang_timeout: float, log_lines: int = 20):
        self.folder = folder
        self.name = folder.root.name
        self.hang_timeout = hang_timeout
        self.log_lines = log_lines
        self._lock = threading.RLock()
        self._tail = EventTail(folder.events)
        self._summary = RunSummary()
        self._pid: int | None = None
        self._alive = False
        self._seen_alive = False         # this process saw the group alive at least once
        self._launcher_alive = False
        self._launcher_code: int | None = None
        self._ranks: dict[int, int] = {}  # rank -> pid, every rank seen
        self._exits: dict[int, RankExit] = {}
        self._stopping = False
        self._failure: Failure | None = None   # detected while watching (cleared on progress)
        self._last_progress = time.monotonic()
        self._refreshed = False
        self._launcher_gone_since: float | None = None
        self._final_seen_at: float | None = None
        self._cleanup: threading.Thread | None = None

    def mark_launched(self) -> None:
        """This process started the run: if it dies before it is ever seen, that is news."""
        with self._lock:
            self._seen_alive = True

    # -- reading --------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The launcher's pid, which is also the group id of every process of the run."""
        with self._lock:
            pid = read_pid(self.folder)
            if pid != self._pid:
                if self._pid is not None:  # launched again in its folder (a resume): start over
                    self._ranks, self._exits, self._failure = {}, {}, None
                    self._seen_alive = self._alive = False
                self._pid = pid
            return self._pid

    def settled(self) -> bool:
        """Over and looked at: nothing about it can change unless it is launched again."""
        with self._lock:
            return (self._refreshed and not self._alive and read_pid(self.folder) == self._pid
                    and (self._summary.final or not self._seen_alive))

    def refresh(self, members: list[procs.Proc] | None = None) -> None:
        """Bring state up to date. `members`: the group's processes from a /proc snapshot taken
        just now (one scan for every run); read here when not given. The snapshot is taken
        before the events are read, so a group seen gone has written all it ever will."""
        pid = self.pid
        if members is None:
            members = procs.snapshot({pid})[pid] if pid else []
        with self._lock:
            if self._summary.update(self._tail.poll()):
                self._last_progress = time.monotonic()
                if self._failure is not None and self._failure.kind == "hung":
                    self._failure = None
            self._observe(pid, members)
            self._refreshed = True

    def _observe(self, pid: int | None, members: list[procs.Proc]) -> None:
        running = procs.live(members)
        ours = bool(running) and procs.belongs_to(running, self.folder.root) or child_running(pid)
        self._alive = ours
        self._seen_alive = self._seen_alive or ours
        self._launcher_alive = ours and any(p.pid == pid for p in running)
        code = reap(pid)
        if code is not None:
            self._launcher_code = code
        if ours:
            for rank, proc in procs.ranks(running).items():
                if self._ranks.get(rank) != proc.pid:  # a new process for this rank (a resume)
                    self._ranks[rank] = proc.pid
                    self._exits.pop(rank, None)
        for rank, rank_pid in self._ranks.items():
            gone = self._exits.get(rank)
            if gone is None or gone.status is None:
                self._check_rank(rank, rank_pid)

    def _check_rank(self, rank: int, pid: int) -> None:
        proc = procs.read_proc(pid)
        if proc is not None and not proc.zombie and proc.pgid == self._pid:
            return
        status = proc.exit_status if proc is not None and proc.zombie else None
        known = self._exits.get(rank)
        if known is None:
            self._exits[rank] = RankExit(rank, pid, status, time.monotonic())
        elif known.status is None and status is not None:
            known.status = status

    def note_exit(self, pid: int) -> None:
        """A watched process just exited (the monitor's pidfd woke): read how, before its
        parent reaps it."""
        with self._lock:
            for rank, rank_pid in self._ranks.items():
                if rank_pid == pid:
                    self._check_rank(rank, pid)

    def watched_pids(self) -> list[int]:
        """Processes whose exit the monitor should wake on: the launcher and the live ranks."""
        with self._lock:
            if not self._alive:
                return []
            pids = [pid for rank, pid in self._ranks.items() if rank not in self._exits]
            return pids + ([self._pid] if self._launcher_alive and self._pid else [])

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of every rank process now running."""
        self.refresh()
        with self._lock:
            return {r: p for r, p in self._ranks.items() if r not in self._exits}

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._alive

    @property
    def state(self) -> str:
        return self.info().state

    def info(self, refresh: bool = True) -> RunInfo:
        """The run as a listing shows it."""
        if refresh:
            self.refresh()
        with self._lock:
            s = self._summary
            state, error, rank = s.state or "starting", s.error, s.error_rank
            if not s.final:
                if self._is_stopping():
                    state = "stopping"
                elif not self._alive:
                    failure = self._exited_failure()
                    state, error, rank = "failed", failure.message, failure.rank
            return RunInfo(self.name, str(self.folder.root), state, self._alive, s.step, s.total_steps,
                           dict(s.metrics), s.start_time, s.end_time, error, rank, self._pid,
                           s.stopped_by_user)

    def failure(self) -> Failure | None:
        """Why the run failed, or is failing now (a dead rank, a hang): the rank and its last
        log lines. None for a run that is fine."""
        self.refresh()
        with self._lock:
            if self._failure is not None:
                return self._failure
            s = self._summary
            if s.state == "failed":
                return self._failure_of("error", s.error or "failed", s.error_rank)
            if not s.final and not self._alive and not self._is_stopping():
                return self._exited_failure()
            return None

    # -- diagnosis ------------------------------------------------------------------------------
    def _failure_of(self, kind: str, message: str, rank: int | None) -> Failure:
        log, lines = log_tail(self.folder, rank, self.log_lines)
        return Failure(self.name, kind, message, rank, log, lines)

    def _culprit(self) -> RankExit | None:
        """The rank that died first and not as a victim of the launcher ending the others."""
        clean = launcher_reported_success(self.folder)
        bad = [e for e in self._exits.values()
               if procs.failed_status(e.status) and not (e.status is None and e.pid in clean)]
        if not bad:
            return None
        first = min(e.seen for e in bad)
        tied = [e for e in bad if e.seen - first < SAME_WAKE_S]
        if len(tied) == 1:
            return tied[0]
        causes = [e for e in tied if not procs.ended_by_sigterm(e.status)]
        seen = [e for e in causes if e.status is not None]
        for group in (seen, causes):
            if len(group) == 1:
                return group[0]
        return None

    def _rank_message(self, culprit: RankExit) -> str:
        text = f"rank {culprit.rank} (pid {culprit.pid}) ended with {procs.describe_status(culprit.status)}"
        _, lines = log_tail(self.folder, culprit.rank, self.log_lines)
        exception = last_exception(lines)
        return text + (f" ({exception})" if exception else "")

    def _exited_failure(self) -> Failure:
        """The failure of a group that is gone without having written a final state."""
        culprit = self._culprit()
        message = "exited without a final state"
        if culprit is not None:
            message += ": " + self._rank_message(culprit)
        elif self._launcher_code is not None:
            message += f" (launcher ended with {procs.describe_returncode(self._launcher_code)})"
        elif not self._summary.events and self.pid is None:
            message = "never started (no launcher pid and no event)"
        if culprit is None:
            log, lines = log_tail(self.folder, None, self.log_lines)
            exception = last_exception(lines)
            message += f"; last error: {exception}" if exception else ""
            return Failure(self.name, "exited", message, None, log, lines)
        return self._failure_of("exited", message, culprit.rank)

    def evaluate(self) -> Failure | None:
        """Decide whether the run just failed; returns a failure once, when it is first seen.
        What is left of a failed run is then ended behind the report, in a thread (no orphan
        left; `wait_cleaned_up`), and its failure recorded in events.jsonl when the run could
        not record it itself."""
        with self._lock:
            if self._is_stopping() or self._failure is not None and self._failure.kind != "hung":
                return None
            failure = self._judge()
            lingering = self._lingering()
            if failure is None and not lingering:
                return None
        if failure is None:  # over by its own account, yet some process of it is still there
            stopping.end_group(self.pid, grace_s=3.0)
            return None
        with self._lock:
            self._failure = failure
        if failure.kind != "hung":  # reported now; the group is ended behind the report
            self._cleanup = threading.Thread(target=self._clean_up_after, args=(failure,),
                                             name=f"end-{self.name}", daemon=True)
            self._cleanup.start()
        return failure

    def _clean_up_after(self, failure: Failure) -> None:
        """End what is left of a failed run and record its failure if the run could not."""
        if failure.kind == "error":  # the run saw it and is shutting down: give it a moment
            stopping.wait_gone(self.pid, time.monotonic() + 5.0)
        stopping.end_group(self.pid, grace_s=3.0)
        with self._lock:
            self.refresh()
            self._record_failure(failure)

    def wait_cleaned_up(self, timeout: float = 30.0) -> None:
        """Wait until the ending of a failed run (started by `evaluate`) is done."""
        cleanup = self._cleanup
        if cleanup is not None:
            cleanup.join(timeout)

    def _lingering(self) -> bool:
        """The run wrote its final state a while ago but part of its group is still there."""
        if not (self._summary.final and self._alive):
            self._final_seen_at = None
            return False
        if self._final_seen_at is None:
            self._final_seen_at = time.monotonic()
        return time.monotonic() - self._final_seen_at > LINGER_GRACE_S

    def _judge(self) -> Failure | None:
        s = self._summary
        if s.final:
            if s.state == "failed" and self._seen_alive:
                culprit = self._culprit()
                if culprit is not None and culprit.rank != s.error_rank:
                    return self._failure_of("rank_died", f"{self._rank_message(culprit)}; the run "
                                            f"then reported: {s.error}", culprit.rank)
                return self._failure_of("error", s.error or "failed", s.error_rank)
            return None
        if not self._alive:
            return self._exited_failure() if self._seen_alive else None
        culprit = self._culprit()
        if culprit is not None and (culprit.status is not None
                                    or time.monotonic() - culprit.seen > UNSEEN_EXIT_GRACE_S):
            return self._failure_of("rank_died", self._rank_message(culprit), culprit.rank)
        if self._launcher_alive:
            self._launcher_gone_since = None
        elif self._launcher_gone_since is None:
            self._launcher_gone_since = time.monotonic()
        elif self._ranks and time.monotonic() - self._launcher_gone_since > LAUNCHER_GRACE_S:
            return self._failure_of("launcher_died", f"the launcher (pid {self._pid}) ended while "
                                    "ranks were still running", None)
        stalled = time.monotonic() - self._last_progress
        if s.state == "running" and stalled > self.hang_timeout and self._failure is None:
            return self._failure_of("hung", f"no training progress for {stalled:.0f} s while running "
                                    f"(last step {s.step}; hang timeout {self.hang_timeout:g} s)", None)
        return None

    def _record_failure(self, failure: Failure) -> None:
        s = self._summary
        if s.final and (s.state != "failed" or s.error_rank == failure.rank):
            return  # the run recorded it itself, and rightly
        self._record({"type": "state", "state": "failed", "error": failure.message,
                      "rank": failure.rank, "step": s.step})

    def _record(self, event: dict) -> None:
        """Append the manager's own final state event, once even with several managers."""
        lock_path = self.folder.root / ".manager.lock"
        with open(lock_path, "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # a second manager waits, then sees ours
            self._summary.update(self._tail.poll())
            if self._summary.final_source == "manager":
                return
            log = EventLog(self.folder.events)
            try:
                log.emit({**event, "source": "manager"})
            finally:
                log.close()
            self._summary.update(self._tail.poll())

    # -- stopping -------------------------------------------------------------------------------
    def stop(self, save: bool = False, timeout: float = 60.0) -> RunInfo:
        """Stop the run: ask it through its control socket (it stops at the next step boundary,
        saving first with `save`) and give it `timeout` s to end by itself, then end whatever
        is left of its process group. Returns the run's info once no process of it remains."""
        with self._lock:
            self.refresh()
            if not self._alive:
                return self.info()
            self._stopping = True
            mark_stopping(self.folder, True)
        try:
            if stopping.ask_to_stop(self.folder, save, timeout):
                stopping.wait_gone(self.pid, time.monotonic() + timeout)
            forced = stopping.alive(self.pid)
            stopping.end_group(self.pid, grace_s=5.0)
            with self._lock:
                self.refresh()
                if not self._summary.final:
                    self._record(stopping.forced_stop_event(save, timeout, forced, self._summary.step))
        finally:
            with self._lock:
                mark_stopping(self.folder, False)
                self._stopping = False
        return self.info()

    def _is_stopping(self) -> bool:
        return self._stopping or stop_in_progress(self.folder)
