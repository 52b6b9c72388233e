"""The failure judgement as a table: observed facts in, verdict out. No process, no file, no
clock: each row runs in microseconds. The same judgement on real runs: tests/test_runs.py."""

from __future__ import annotations

import signal

import pytest

from contract.protocol.states import RunState
from supervisor.judgement import (LAUNCHER_GRACE_S, LINGER_GRACE_S, UNSEEN_EXIT_GRACE_S, Facts, RankExit,
                                  VerdictKind, culprit, judge, last_exception, post_mortem)

NOW = 1000.0
# raw wait statuses, as /proc shows a zombie's
KILLED = int(signal.SIGKILL)          # ended by SIGKILL
TERMED = int(signal.SIGTERM)          # ended by SIGTERM: how a launcher ends the survivors
EXIT_1 = 1 << 8                       # exit code 1
EXIT_0 = 0


def gone(rank: int, status: int | None, seen: float = NOW - 0.5) -> RankExit:
    return RankExit(rank=rank, pid=100 + rank, status=status, seen=seen)


def facts(**kw) -> Facts:
    """A live 2-rank run, running, progressing: the baseline each row changes."""
    base = dict(now=NOW, state=RunState.RUNNING, step=7, events=12, pid=50, alive=True,
                seen_alive=True, launcher_alive=True, ranks_seen=2, last_progress=NOW - 1.0,
                hang_timeout=300.0)
    return Facts(**{**base, **kw})


# (name, facts, expected (kind, rank) or None, words the reason must hold)
CASES = [
    ("a healthy run", facts(), None, ()),
    ("a stop in progress excuses everything",
     facts(stopping=True, alive=False, exits=(gone(1, KILLED),)), None, ()),
    ("finished and gone", facts(state=RunState.FINISHED, alive=False), None, ()),
    ("failed by its own report", facts(state=RunState.FAILED, alive=False, error="OOM", error_rank=0),
     (VerdictKind.ERROR, 0), ("OOM",)),
    ("an old failed run this process never saw alive",
     facts(state=RunState.FAILED, alive=False, seen_alive=False, error="OOM"), None, ()),
    ("failed, but a rank died first: the dead rank is the cause",
     facts(state=RunState.FAILED, alive=False, error="gloo: connection closed", error_rank=0,
           exits=(gone(1, KILLED),)),
     (VerdictKind.RANK_DIED, 1), ("rank 1 (pid 101) ended with signal SIGKILL",
                                  "the run then reported: gloo: connection closed")),
    # rank 1 was killed; rank 0 wrote its lost-peer error before rank 1's exit was seen: the
    # judgement waits while the group goes (however long that takes) rather than blame rank 0 ...
    ("failed by a rank's report, the group still going: the rank that died first may not be seen yet",
     facts(state=RunState.FAILED, error="gloo: Connection reset by peer", error_rank=0, final_since=NOW - 20.0),
     None, ()),
    # ... and once seen, the killed rank is the cause
    ("failed by a rank's report, then the killed rank is seen: it is the cause",
     facts(state=RunState.FAILED, error="gloo: Connection reset by peer", error_rank=0, final_since=NOW - 1.0,
           exits=(gone(1, KILLED),)), (VerdictKind.RANK_DIED, 1), ("rank 1 (pid 101)", "SIGKILL",
                                                                   "the run then reported: gloo")),
    ("failed by a rank's report, and the group gone with no other rank dead: the report",
     facts(state=RunState.FAILED, error="OOM", error_rank=0, alive=False, final_since=None),
     (VerdictKind.ERROR, 0), ("OOM",)),
    ("failed by a rank's report, the group stuck on the way out past the bound: the report",
     facts(state=RunState.FAILED, error="OOM", error_rank=0, final_since=NOW - LINGER_GRACE_S - 1.0),
     (VerdictKind.ERROR, 0), ("OOM",)),
    ("failed, and the rank that reported it is the one that ended",
     facts(state=RunState.FAILED, alive=False, error="boom", error_rank=1, exits=(gone(1, EXIT_1),)),
     (VerdictKind.ERROR, 1), ("boom",)),
    ("finished, processes still there a while after",
     facts(state=RunState.FINISHED, final_since=NOW - LINGER_GRACE_S - 1),
     (VerdictKind.LINGERING, None), ("final state",)),
    ("finished, processes still there, briefly",
     facts(state=RunState.FINISHED, final_since=NOW - 1.0), None, ()),
    ("gone without a final state: the killed rank, not its SIGTERMed victim",
     facts(alive=False, exits=(gone(1, KILLED, NOW - 2.0), gone(0, TERMED, NOW - 2.0 + 0.01))),
     (VerdictKind.EXITED, 1), ("exited without a final state: rank 1", "SIGKILL")),
    ("gone without a final state, no rank to blame, launcher's code known",
     facts(alive=False, launcher_alive=False, launcher_code=1),
     (VerdictKind.EXITED, None), ("launcher ended with exit code 1",)),
    ("gone, launcher ended by a signal",
     facts(alive=False, launcher_alive=False, launcher_code=-9),
     (VerdictKind.EXITED, None), ("launcher ended with signal SIGKILL",)),
    ("never started", facts(alive=False, pid=None, events=0, ranks_seen=0, state=None),
     (VerdictKind.EXITED, None), ("never started",)),
    ("gone, but never seen alive here", facts(alive=False, seen_alive=False), None, ()),
    ("a rank killed while the others go on",
     facts(exits=(gone(1, KILLED),)), (VerdictKind.RANK_DIED, 1), ("rank 1 (pid 101)", "SIGKILL")),
    ("a rank that exited with an error code", facts(exits=(gone(0, EXIT_1),)),
     (VerdictKind.RANK_DIED, 0), ("exit code 1",)),
    ("a rank that ended cleanly", facts(exits=(gone(0, EXIT_0),)), None, ()),
    ("a rank vanished unseen, just now: maybe a clean exit", facts(exits=(gone(1, None, NOW - 1.0),)),
     None, ()),
    ("a rank vanished unseen, long ago", facts(exits=(gone(1, None, NOW - UNSEEN_EXIT_GRACE_S - 1),)),
     (VerdictKind.RANK_DIED, 1), ("unknown exit status",)),
    ("a rank vanished unseen that the launcher logged as clean",
     facts(exits=(gone(1, None, NOW - 60.0),), clean_pids=frozenset({101})), None, ()),
    ("the launcher gone, ranks going on", facts(launcher_alive=False,
                                                launcher_gone_since=NOW - LAUNCHER_GRACE_S - 1),
     (VerdictKind.LAUNCHER_DIED, None), ("the launcher (pid 50) ended",)),
    ("the launcher gone a moment ago (a group being torn down)",
     facts(launcher_alive=False, launcher_gone_since=NOW - 0.5), None, ()),
    ("the launcher gone before any rank started",
     facts(launcher_alive=False, launcher_gone_since=NOW - 60.0, ranks_seen=0), None, ()),
    ("running without progress past the hang timeout", facts(last_progress=NOW - 301.0),
     (VerdictKind.HUNG, None), ("no training progress for 301 s", "last step 7", "hang timeout 300 s")),
    ("paused for long is no hang", facts(state=RunState.PAUSED, last_progress=NOW - 3600.0), None, ()),
    ("starting for long is no hang (loading a big model)",
     facts(state=RunState.STARTING, last_progress=NOW - 3600.0), None, ()),
    ("a dead rank outranks a hang", facts(last_progress=NOW - 301.0, exits=(gone(1, KILLED),)),
     (VerdictKind.RANK_DIED, 1), ()),
]


@pytest.mark.parametrize("name,observed,expected,words", CASES, ids=[c[0] for c in CASES])
def test_judgement(name, observed, expected, words):
    verdict = judge(observed)
    if expected is None:
        assert verdict is None, verdict
        return
    assert verdict is not None
    assert (verdict.kind, verdict.rank) == expected
    for w in words:
        assert w in verdict.reason + verdict.suffix, (w, verdict)


# A rank killed while the others train, the evidence arriving in every order: the rank's own
# exit (read from its zombie, or gone unseen because the launcher reaped it first), rank 0's
# lost-peer report in events.jsonl, rank 0's exit, the launcher's report. Each row is one order.
LOST = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"
FAILED_BY_LOST_PEER = dict(state=RunState.FAILED, error=LOST, error_rank=0, final_since=NOW - 0.5)
ORDERS = [
    ("rank 1's SIGKILL read first, then rank 0's report: at once, group alive",
     facts(**FAILED_BY_LOST_PEER, exits=(gone(1, KILLED, NOW - 0.6),)), (VerdictKind.RANK_DIED, 1)),
    ("rank 0's report first, rank 1 not seen gone yet: wait (no timer decides)",
     facts(**{**FAILED_BY_LOST_PEER, "final_since": NOW - 25.0}), None),
    ("rank 0's report first, then rank 1 seen gone unseen (reaped by the launcher)",
     facts(**FAILED_BY_LOST_PEER, exits=(gone(1, None, NOW - 0.1),)), (VerdictKind.RANK_DIED, 1)),
    ("rank 0's report, then both gone in one look: rank 1 unseen, rank 0 exit 1 with a lost peer",
     facts(**FAILED_BY_LOST_PEER, alive=False, lost_peer=frozenset({0}), raised=frozenset({0}),
           exits=(gone(0, EXIT_1), gone(1, None))), (VerdictKind.RANK_DIED, 1)),
    ("... rank 0's exit listed first",
     facts(**FAILED_BY_LOST_PEER, alive=False, lost_peer=frozenset({0}), raised=frozenset({0}),
           exits=(gone(1, None), gone(0, EXIT_1))), (VerdictKind.RANK_DIED, 1)),
    ("both gone in one look, rank 0's error unrecognised, the launcher reported a SIGKILL",
     facts(**{**FAILED_BY_LOST_PEER, "error": "RuntimeError: gloo said something new"}, alive=False,
           raised=frozenset({0}), launcher_status=KILLED, exits=(gone(0, EXIT_1), gone(1, None))),
     (VerdictKind.RANK_DIED, 1)),
    ("a SIGKILL read from rank 1's zombie outranks rank 0's exit code seen in the same look",
     facts(**FAILED_BY_LOST_PEER, exits=(gone(0, EXIT_1), gone(1, KILLED))), (VerdictKind.RANK_DIED, 1)),
    ("rank 0 killed (no final state): both gone in one look, rank 0 unseen, rank 1 lost its peer",
     facts(alive=False, lost_peer=frozenset({1}), raised=frozenset({1}), launcher_code=247,
           exits=(gone(1, EXIT_1), gone(0, None))), (VerdictKind.EXITED, 0)),
    ("rank 0 killed, the launcher's report gives the signal",
     facts(alive=False, lost_peer=frozenset({1}), raised=frozenset({1}), launcher_status=KILLED,
           exits=(gone(1, EXIT_1), gone(0, None))), (VerdictKind.EXITED, 0)),
    ("rank 0 killed and seen first, rank 1's exit a look later",
     facts(alive=False, exits=(gone(0, KILLED, NOW - 2.0), gone(1, EXIT_1, NOW - 1.0))), (VerdictKind.EXITED, 0)),
    ("rank 0 killed while running: seen at once, before rank 1 fails",
     facts(exits=(gone(0, KILLED),)), (VerdictKind.RANK_DIED, 0)),
    ("a real error of rank 0, rank 1 then SIGTERMed by the launcher: rank 0's report",
     facts(state=RunState.FAILED, error="ValueError: bad batch", error_rank=0, alive=False,
           raised=frozenset({0}), exits=(gone(0, EXIT_1), gone(1, TERMED))), (VerdictKind.ERROR, 0)),
    ("a real error of rank 0, rank 1 gone unseen in the same look: rank 0's report",
     facts(state=RunState.FAILED, error="ValueError: bad batch", error_rank=0, alive=False,
           raised=frozenset({0}), exits=(gone(0, None), gone(1, None))), (VerdictKind.ERROR, 0)),
    ("torchrun names the killed rank's pid",
     facts(alive=False, launcher_status=KILLED, launcher_pid=100,
           exits=(gone(1, None), gone(0, None))), (VerdictKind.EXITED, 0)),
]


@pytest.mark.parametrize("name,observed,expected", ORDERS, ids=[c[0] for c in ORDERS])
def test_the_rank_that_died_is_named_whatever_the_order(name, observed, expected):
    verdict = judge(observed)
    assert (None if verdict is None else (verdict.kind, verdict.rank)) == expected, verdict
    if expected is not None and expected[0] != VerdictKind.ERROR and (
            observed.launcher_status or any(e.status == KILLED for e in observed.exits)):
        assert "SIGKILL" in verdict.reason, verdict


def test_a_report_after_the_end_judges_as_the_watcher_did():
    """A listing or the terminal's report after the group is gone: the dead rank, not rank 0's
    lost-peer report (post_mortem ignores that this process never saw the run alive)."""
    over = facts(**FAILED_BY_LOST_PEER, alive=False, seen_alive=False, exits=(gone(1, None),))
    assert judge(over) is None
    verdict = post_mortem(over)
    assert (verdict.kind, verdict.rank) == (VerdictKind.RANK_DIED, 1)
    assert verdict.message([]).endswith("the run then reported: " + LOST)


# who went first: (exits, launcher-logged clean pids) -> the culprit's rank or None
CULPRITS = [
    ((gone(0, TERMED, 10.0), gone(1, KILLED, 10.01)), frozenset(), 1),   # one wake: not-SIGTERM wins
    ((gone(0, TERMED, 9.0), gone(1, KILLED, 10.0)), frozenset(), 0),     # clearly first: first wins
    ((gone(0, KILLED, 10.0), gone(1, KILLED, 10.01)), frozenset(), None),  # cannot tell
    ((gone(0, None, 10.0), gone(1, KILLED, 10.01)), frozenset(), 1),     # the one whose end was seen
    ((gone(0, None, 10.0), gone(1, EXIT_1, 10.0)), frozenset(), 1),      # an exit code over a silent vanish
    ((gone(0, None, 10.0),), frozenset({100}), None),                    # logged clean by the launcher
    ((gone(0, EXIT_0, 10.0), gone(1, EXIT_0, 10.0)), frozenset(), None),  # both ended well
    ((), frozenset(), None),
]


@pytest.mark.parametrize("exits,clean,rank", CULPRITS)
def test_culprit(exits, clean, rank):
    found = culprit(facts(exits=exits, clean_pids=clean))
    assert (found.rank if found else None) == rank


def test_the_message_takes_the_exception_from_the_log_it_points_at():
    lines = ["step 7 loss 1.2", "Traceback (most recent call last):", '  File "x.py", line 3',
             "RuntimeError: CUDA error: out of memory", "[/__w/pytorch/third_party/gloo/pair.cc:537] closed"]
    died = judge(facts(exits=(gone(1, EXIT_1),)))
    assert died.message(lines) == ("rank 1 (pid 101) ended with exit code 1 "
                                   "(RuntimeError: CUDA error: out of memory)")
    assert died.message(["no traceback here"]) == "rank 1 (pid 101) ended with exit code 1"
    first = judge(facts(state=RunState.FAILED, alive=False, error="gloo", error_rank=0,
                        exits=(gone(1, KILLED),)))
    assert first.message(["ValueError: bad"]) == ("rank 1 (pid 101) ended with signal SIGKILL "
                                                  "(ValueError: bad); the run then reported: gloo")
    nobody = judge(facts(alive=False, launcher_code=2))
    assert nobody.message(["KeyError: 'x'"]) == ("KeyError: 'x'; exited without a final state (launcher "
                                                 "ended with exit code 2)")  # the cause first
    assert nobody.message(["ConfigError: invalid run config (1 problem):", "  - data.train: no such file"]) == (
        "data.train: no such file (ConfigError: invalid run config, 1 problem); exited without a final "
        "state (launcher ended with exit code 2)")
    assert nobody.message([LOST]) == ("exited without a final state (launcher ended with exit code 2); "
                                      f"last error: {LOST}")  # a lost peer is no cause
    assert last_exception(["[/__w/x.cc:1] Error: no", "ok"]) is None


def test_the_launcher_s_report_is_read_from_the_latest_launch_only(tmp_path):
    """DeepSpeed's launch.py and torchrun, as they word the first rank they saw fail."""
    from contract.run_folder import RunFolder
    from supervisor.records import launcher_reported_failure
    folder = RunFolder(tmp_path)
    folder.logs.mkdir(parents=True)
    runner = "[2026-12-04 20:40:01,100] [INFO] [runner.py:630:main] cmd = /py -u -m deepspeed.launcher.launch ...\n"
    ds = ("[2026-12-04 20:40:30,754] [ERROR] [launch.py:259:sigkill_handler] ['/py', '-u', '-m', "
          "'engine.worker', '--local_rank=1', '--run-dir', '/runs/r'] exits with return code = {}\n")
    log = folder.logs / "launcher.log"
    log.write_text(runner + ds.format(-9) + runner)
    assert launcher_reported_failure(folder) == (None, None)  # the resumed launch has not failed
    log.write_text(runner + ds.format(-9))
    assert launcher_reported_failure(folder) == (KILLED, None)
    log.write_text(runner + ds.format(1))
    assert launcher_reported_failure(folder) == (EXIT_1, None)
    log.write_text("node-b: " + ds.format(-9))  # another machine's: supervisor.remote reads those
    assert launcher_reported_failure(folder) == (None, None)
    log.write_text("  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 4242)\n")
    assert launcher_reported_failure(folder) == (KILLED, 4242)


def test_a_failure_is_worded_cause_first():
    """An error whose first line only announces its problems ("invalid run config (1 problem):")
    is worded with the problems first: in the run's own report as read by every front end, and
    in an exception taken from a log."""
    from supervisor.judgement import cause_first
    from supervisor.summary import RunSummary
    error = "ConfigError: invalid run config (2 problems):\n  - data.train: no such file or folder: /d\n  - lr: bad"
    worded = "data.train: no such file or folder: /d; lr: bad (ConfigError: invalid run config, 2 problems)"
    assert cause_first(error) == worded
    assert cause_first("RuntimeError: plain") == "RuntimeError: plain"
    summary = RunSummary()
    summary.update([{"type": "state", "state": RunState.FAILED.value, "error": error, "rank": 0}])
    assert summary.error == worded
    log = ["Traceback (most recent call last):", '  File "engine/worker.py", line 5, in run',
           "    cfg = load_config(folder.config)",
           "contract.config.schema.ConfigError: invalid run config (1 problem):",
           "  - data.train: no such file or folder: /d", "[rank0] exiting"]
    assert last_exception(log) == ("data.train: no such file or folder: /d "
                                   "(contract.config.schema.ConfigError: invalid run config, 1 problem)")


def unwatched_run(tmp_path, killed: int, code: int, final: bool):
    """A 2-rank run folder as a run that nobody watched leaves it: rank `killed` died (SIGKILL),
    the other lost its peer; the launcher reported `code` (the first rank it saw fail)."""
    from contract.run_folder import RunFolder
    folder = RunFolder(tmp_path / "runs" / "r")
    folder.logs.mkdir(parents=True)
    events = ['{"type": "state", "state": "starting"}', '{"type": "state", "state": "running"}']
    if final:  # rank 0 survived and wrote its lost-peer error
        events.append('{"type": "state", "state": "failed", "rank": 0, "error": "%s"}' % LOST)
    folder.events.write_text("\n".join(events) + "\n")
    spawned = "".join(f"[2026-12-04 20:40:0{r},1] [INFO] [launch.py:245:main] process {500 + r} spawned with "
                      f"command: ['/py', '-u', '-m', 'engine.worker', '--local_rank={r}', '--run-dir', 'r']\n"
                      for r in (0, 1))
    (folder.logs / "launcher.log").write_text(
        "[2026-12-04 20:40:00,1] [INFO] [runner.py:630:main] cmd = /py -u -m deepspeed.launcher.launch\n" + spawned
        + "[2026-12-04 20:41:00,1] [ERROR] [launch.py:259:sigkill_handler] ['/py', '-u', '-m', 'engine.worker', "
        f"'--local_rank=1'] exits with return code = {code}\n")
    for rank in (0, 1):
        tail = ["step 7"] if rank == killed else ["Traceback (most recent call last):", LOST]
        folder.rank_log(rank).write_text("\n".join(tail) + "\n")
    (folder.root / "launcher.pid").write_text("999999")  # long gone
    return folder


@pytest.mark.parametrize("killed,code,final", [(1, -9, True), (1, 1, True), (0, -9, False), (0, 1, False)])
def test_a_run_nobody_watched_is_judged_from_its_launcher_s_log(tmp_path, killed, code, final):
    """Looked at after the end by a front end that never saw its processes: the rank that died
    is named from what the launcher logged (which ranks it started, the first failure it saw) and
    the rank logs, whichever rank's code the launcher happened to report."""
    from supervisor import RunManager
    unwatched_run(tmp_path, killed, code, final)
    failure = RunManager(tmp_path / "runs").failure("r")
    assert failure.rank == killed, failure
    assert failure.log.endswith(f"rank{killed}.log") and failure.lines == ("step 7",)
    assert ("SIGKILL" in failure.message) == (code == -9), failure.message
