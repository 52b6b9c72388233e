"""One run: its folder, its process group, its state, and how it is stopped, waited on or found
broken.

A run's state comes from two places: its event log (what the run said) and its process group
(whether it is still there). The handle observes both and keeps the facts (`judgement.Facts`);
what they mean, a dead rank, a hang, a group gone without a final state, is decided by the pure
`judgement.judge`. The handle acts on the verdict: reports it once, ends what is left of the
group, and records the failure in the event log when the run could not.
"""

from __future__ import annotations

import dataclasses
import fcntl
import threading
import time

from contract.protocol.commands import Stop
from contract.protocol.states import RunState
from contract.run_folder import EventLog, EventTail, RunFolder
from contract.events import StateEvent

from contract.config.load import load_config
from supervisor import procs, restart, stopping
from supervisor.launch import spawn
from supervisor.exit_evidence import exit_evidence
from supervisor.judgement import Facts, RankExit, Verdict, VerdictKind, exited, judge, post_mortem
from supervisor.remote import RemoteLog
from supervisor.records import (Failure, RunInfo, adopt_child, child_running, launcher_spawned,
                                launcher_reported_success, log_tail, mark_stopping, read_pid, reap,
                                stop_in_progress)
from supervisor.summary import RunSummary

# How often `wait` looks again for processes it cannot wait on yet (ranks not started when it
# began): a bound on a missed start, not how exits are noticed (those wake it at once).
_RELOOK_S = 1.0


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
        self._remote = RemoteLog(folder.logs / "launcher.log")  # ranks on other machines
        self._launch_env: dict[str, str] = {}  # the extra environment of its launch (restarts reuse it)
        self._launched_here = False  # this handle started the run: only then does it restart it
        self._die_with_parent = False  # the run ends with this process (a restart's group too)
        self.restarts = 0  # times this handle relaunched the group (supervisor.restart)

    def mark_launched(self, env: dict[str, str] | None = None, die_with_parent: bool = False) -> None:
        """This process started the run: if it dies before it is ever seen, that is news.
        `env`, `die_with_parent`: how it was started (a restart starts it so again)."""
        with self._lock:
            self._seen_alive = True
            self._launched_here = True
            self._launch_env = dict(env or {})
            self._die_with_parent = die_with_parent

    # -- reading --------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The launcher's pid, which is also the group id of every process of the run."""
        with self._lock:
            pid = read_pid(self.folder)
            if pid != self._pid:
                if self._pid is not None:  # launched again in its folder (a resume): start over
                    self._ranks, self._exits, self._failure = {}, {}, None
                    self._remote = RemoteLog(self.folder.logs / "launcher.log")
                    self._seen_alive = self._alive = False
                self._pid = pid
            return self._pid

    def settled(self) -> bool:
        """Over and looked at: nothing about it can change unless it is launched again."""
        with self._lock:
            return (self._refreshed and not self._alive and read_pid(self.folder) == self._pid
                    and (self._summary.final or not self._seen_alive))

    def refresh(self, members: list[procs.Proc] | None = None) -> None:
        """Bring state up to date. `members`: the group's processes from a snapshot taken just
        now (one pass for every run); read here when not given. The snapshot is taken before
        the events are read, so a group seen gone has written all it ever will."""
        pid = self.pid
        if members is None:
            members = procs.snapshot({pid})[pid] if pid else []
        with self._lock:
            if self._summary.update(self._tail.poll_events()):
                self._last_progress = time.monotonic()
                if self._failure is not None and self._failure.kind == VerdictKind.HUNG:
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
        now = time.monotonic()  # one look, one time: exits found together are told apart by evidence
        for rank, rank_pid in self._ranks.items():
            gone = self._exits.get(rank)
            if gone is None or gone.status is None:
                self._check_rank(rank, rank_pid, now)
        self._observe_remote()
        if not ours or self._launcher_alive:
            self._launcher_gone_since = None
        elif self._launcher_gone_since is None:
            self._launcher_gone_since = now
        if self._summary.final and ours:
            self._final_seen_at = self._final_seen_at or now
        else:
            self._final_seen_at = None

    def _observe_remote(self) -> None:
        """Ranks on other machines that their launchers reported dead (read after the process
        snapshot: a launcher seen gone has logged all it ever will)."""
        for gone in self._remote.poll():
            if gone.rank is not None and gone.rank not in self._exits and gone.rank not in self._ranks:
                self._exits[gone.rank] = RankExit(gone.rank, gone.pid, gone.status, time.monotonic(), gone.host)

    def _check_rank(self, rank: int, pid: int, now: float) -> None:
        proc = procs.read_proc(pid)
        if proc is not None and not proc.zombie and proc.pgid == self._pid:
            return
        status = proc.exit_status if proc is not None and proc.zombie else None
        known = self._exits.get(rank)
        if known is None:
            self._exits[rank] = RankExit(rank, pid, status, now)
        elif known.status is None and status is not None:
            self._exits[rank] = dataclasses.replace(known, status=status)

    def note_exit(self, pid: int, seen: float | None = None) -> None:
        """A watched process just exited (its pidfd woke a watcher): read how, before its
        parent reaps it. `seen`: when the watcher woke (one time for every pid of one wake)."""
        seen = time.monotonic() if seen is None else seen
        with self._lock:
            for rank, rank_pid in self._ranks.items():
                if rank_pid == pid:
                    self._check_rank(rank, pid, seen)

    def watched_pids(self) -> list[int]:
        """Processes whose exit a watcher should wake on: the launcher and the live ranks."""
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
        """The run's state, a `contract.protocol.states.RunState` value."""
        return self.info().state

    def info(self, refresh: bool = True) -> RunInfo:
        """The run as a listing shows it."""
        if refresh:
            self.refresh()
        with self._lock:
            s = self._summary
            state, error, rank = s.state or RunState.STARTING.value, s.error, s.error_rank
            if not s.final:
                if self._is_stopping():
                    state = RunState.STOPPING.value
                elif not self._alive:
                    failure = self._failure_of(exited(self._facts()))
                    state, error, rank = RunState.FAILED.value, failure.message, failure.rank
            return RunInfo(self.name, str(self.folder.root), RunState(state), self._alive, s.step, s.total_steps,
                           dict(s.metrics), s.start_time, s.end_time, error, rank, self._pid,
                           s.stopped_by_user, s.reason if state == RunState.FINISHED else None)

    def failure(self) -> Failure | None:
        """Why the run failed, or is failing now (a dead rank, a hang): the rank and its last
        log lines. None for a run that is fine."""
        self.refresh()
        with self._lock:
            if self._failure is not None:
                return self._failure
            s = self._summary
            if s.state == RunState.FAILED or not s.final and not self._alive and not self._is_stopping():
                # judged as if over: the rank that died first, not just the run's own report
                verdict = post_mortem(self._facts())
                if verdict is not None:
                    return self._failure_of(verdict)
            if s.state == RunState.FAILED:
                return self._failure_of(Verdict(VerdictKind.ERROR, s.error_rank, s.error or str(RunState.FAILED)))
            return None

    # -- judging --------------------------------------------------------------------------------
    def _facts(self) -> Facts:
        s = self._summary
        exits = tuple(self._exits.values()) or self._unwatched_exits()
        return Facts(
            now=time.monotonic(), state=s.run_state, step=s.step, error=s.error,
            error_rank=s.error_rank, events=s.events, pid=self._pid, alive=self._alive,
            seen_alive=self._seen_alive, stopping=self._is_stopping(),
            launcher_alive=self._launcher_alive, launcher_gone_since=self._launcher_gone_since,
            launcher_code=self._launcher_code, ranks_seen=len(self._ranks), exits=exits,
            clean_pids=frozenset(launcher_reported_success(self.folder)) if exits else frozenset(),
            last_progress=self._last_progress, hang_timeout=self.hang_timeout,
            final_since=self._final_seen_at, remote=self._remote.multi_host, **exit_evidence(self.folder, exits, self.log_lines))

    def _unwatched_exits(self) -> tuple[RankExit, ...]:
        """The ranks of a failed run that ended before this process ever saw one of them (it was
        not watching: a detached run, a front end started later), as their launcher started them
        on this machine: gone, how unknown. The launcher's report and the rank logs then say who
        died first, as for a watched run."""
        if self._ranks or self._alive or (self._summary.final and self._summary.state != RunState.FAILED):
            return ()
        return tuple(RankExit(rank, pid, None, 0.0) for rank, pid in launcher_spawned(self.folder).items())

    def _failure_of(self, verdict: Verdict) -> Failure:
        """The verdict as a report: worded with the last lines of the log it points at."""
        log, lines = log_tail(self.folder, verdict.rank, self.log_lines)
        return Failure(self.name, verdict.kind.value, verdict.message(lines), verdict.rank, log, lines)

    def evaluate(self) -> Failure | None:
        """Decide whether the run just failed; returns a failure once, when it is first seen.
        What is left of a failed run is then ended behind the report, in a thread (no orphan
        left; `wait_cleaned_up`), and its failure recorded in events.jsonl when the run could
        not record it itself."""
        with self._lock:
            if self._failure is not None and self._failure.kind != VerdictKind.HUNG:
                return None
            verdict = judge(self._facts())
            if verdict is None or verdict.kind == VerdictKind.HUNG and self._failure is not None:
                return None
        if verdict.kind == VerdictKind.LINGERING:  # over by its own account: end the rest
            stopping.end_group(self.pid, self.folder.root, grace_s=3.0)
            return None
        failure = self._failure_of(verdict)
        with self._lock:
            self._failure = failure
        if verdict.kind != VerdictKind.HUNG:  # reported now; the group is ended behind the report
            self._cleanup = threading.Thread(target=self._clean_up_after, args=(failure,),
                                             name=f"end-{self.name}", daemon=True)
            self._cleanup.start()
        return failure

    def _clean_up_after(self, failure: Failure) -> None:
        """End what is left of a failed run and record its failure if the run could not."""
        if failure.kind == VerdictKind.ERROR:  # the run saw it and is shutting down: a moment
            stopping.wait_gone(self.pid, self.folder.root, time.monotonic() + 5.0)
        stopping.end_group(self.pid, self.folder.root, grace_s=3.0)
        with self._lock:
            self.refresh()
            if not self._is_stopping() and self._restart(failure):
                return
            self._record_failure(failure)

    def _restart(self, failure: Failure) -> bool:
        """Relaunch the whole group from the latest complete checkpoint when `fault.max_restarts`
        allows (supervisor.restart); False: the failure is the run's final one (its message then
        says why no restart came). Only the handle that started the run restarts it: it knows the
        launch's environment, and a second watcher of the run (another front end) must not
        launch the group a second time."""
        if not self._launched_here:  # the starter relaunches it, if it will: not a failure yet
            return restart.relaunch_may_come(self.folder)
        try:
            cfg = load_config(self.folder.config)
            cfg.fault.max_restarts  # noqa: B018 - a config of this run's version has the section
        except Exception:  # noqa: BLE001 - no readable config: nothing to restart with
            return False
        step = self._summary.step
        decision = restart.decide(cfg.fault.max_restarts, restart.earlier_failures(self.folder), step,
                                  restart.latest_complete(self.folder))
        if not decision.restart:
            if decision.why_not:
                self._failure = dataclasses.replace(failure, message=f"{failure.message} ({decision.why_not})")
            return False
        cfg = restart.prepare(self.folder, decision, failure.rank, failure.kind, failure.message, step)
        launched = spawn(cfg, self.folder, extra_env=self._launch_env, die_with_parent=self._die_with_parent,
                         from_any_thread=True)
        adopt_child(launched.process)
        self.restarts += 1
        self._seen_alive = True
        return True

    def relaunched(self, timeout: float = restart.RELAUNCH_WAIT_S) -> bool:
        """With every process of the run gone (`wait` said so) and a failure ended
        (`wait_cleaned_up`): whether the group runs again, relaunched by this handle or by the
        run's starter (supervisor.restart), waiting up to `timeout` s while one may come."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            if self.alive:
                return True
            if time.monotonic() >= deadline or not restart.relaunch_may_come(self.folder):
                return False
            time.sleep(0.2)

    def wait_cleaned_up(self, timeout: float = 30.0) -> None:
        """Wait until the ending of a failed run (started by `evaluate`) is done."""
        cleanup = self._cleanup
        if cleanup is not None:
            cleanup.join(timeout)

    def _record_failure(self, failure: Failure) -> None:
        failure = self._failure or failure  # with why no restart came, when one was asked for
        s = self._summary
        if s.final and (s.state != RunState.FAILED or s.error_rank == failure.rank):
            return  # the run recorded it itself, and rightly
        self._record(StateEvent(state=RunState.FAILED, error=failure.message, rank=failure.rank, step=s.step))

    def _record(self, event: StateEvent) -> None:
        """Append the manager's own final state event, once even with several managers."""
        lock_path = self.folder.root / ".manager.lock"
        with open(lock_path, "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # a second manager waits, then sees ours
            self._summary.update(self._tail.poll_events())
            if self._summary.final_source == "manager":
                return
            log = EventLog(self.folder.events)
            try:
                log.emit(event.model_copy(update={"source": "manager"}))
            finally:
                log.close()
            self._summary.update(self._tail.poll_events())

    # -- waiting and stopping -------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no process of the run is left (True), or `timeout` s have passed (False).
        Waits on the processes themselves (pidfds of the launcher and every rank): an exit wakes
        it at once, and how a rank ended is read before anyone reaps it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = procs.ExitWatch()
        try:
            while True:
                self.refresh()
                if not self.alive:
                    return True
                for pid in self.watched_pids():
                    watch.add(pid)
                left = _RELOOK_S if deadline is None else min(_RELOOK_S, deadline - time.monotonic())
                if left <= 0:
                    return False
                exited = watch.wait(left)
                woke = time.monotonic()
                for pid in exited:
                    self.note_exit(pid, woke)
                    watch.discard(pid)
        finally:
            watch.close()

    def stop(self, save: bool = Stop().save, timeout: float = 60.0) -> RunInfo:
        """Stop the run: ask it through its control socket (it stops at the next step boundary,
        saving first with `save`: the contract's `Stop` default) and give it `timeout` s to end
        by itself, then end whatever is left of its process group. Returns the run's info once
        no process of it remains."""
        with self._lock:
            self.refresh()
            if not self._alive:
                return self.info()
            self._stopping = True
            mark_stopping(self.folder, True)
        try:
            if stopping.ask_to_stop(self.folder, save, timeout):
                stopping.wait_gone(self.pid, self.folder.root, time.monotonic() + timeout)
            forced = stopping.alive(self.pid, self.folder.root)
            stopping.end_group(self.pid, self.folder.root, grace_s=5.0)
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
