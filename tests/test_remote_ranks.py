"""Ranks on other machines: what DeepSpeed's multi-node launcher log says about them
(supervisor.remote), and how the failure judgement names the rank and host that died first.
The log lines are DeepSpeed 0.19.8's and pdsh's own, as a two-host run wrote them
(tests/test_two_hosts.py runs the real thing)."""

import dataclasses

from contract.protocol.states import RunState
from supervisor.judgement import LINGER_GRACE_S, Facts, RankExit, VerdictKind, judge
from supervisor.remote import RemoteLog, wait_status

RUNNER = ("[2026-12-03 18:39:42,780] [INFO] [runner.py:618:main] cmd = pdsh -S -f 1024 -w node-a,node-b "
          "export PYTHONUNBUFFERED=1; cd /repo; python -u -m deepspeed.launcher.launch ...\n")


def node(host: str, ranks: str, pid: int) -> str:
    return (f"{host}: [2026-12-03 18:39:46,820] [INFO] [launch.py:169:main] global_rank_mapping=defaultdict("
            f"<class 'list'>, {ranks})\n"
            f"{host}: [2026-12-03 18:39:46,824] [INFO] [launch.py:245:main] process {pid} spawned with command: "
            "['/repo/.venv/bin/python', '-u', '-m', 'engine.worker', '--local_rank=0', '--run-dir', '/runs/r']\n")


def failed(host: str, code: int) -> str:
    return (f"{host}: [2026-12-03 18:40:29,754] [ERROR] [launch.py:259:sigkill_handler] ['/repo/.venv/bin/python',"
            f" '-u', '-m', 'engine.worker', '--local_rank=0', '--run-dir', '/runs/r'] exits with return code = {code}\n")


MAPPING = "{'node-a': [0], 'node-b': [1]}"


def test_a_killed_remote_rank_is_read_with_its_host_pid_and_signal(tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text(RUNNER + node("node-a", MAPPING, 101) + node("node-b", MAPPING, 202))
    remote = RemoteLog(log)
    assert remote.poll() == [] and remote.multi_host and remote.ranks == {"node-a": [0], "node-b": [1]}
    with open(log, "a") as f:
        f.write(failed("node-a", 1) + failed("node-b", -9) + "pdsh@here: node-b: ssh exited with exit code 247\n")
        f.write("node-a: half a line")  # not complete yet: left for the next poll
    got = {e.host: e for e in remote.poll()}
    assert (got["node-b"].rank, got["node-b"].pid, got["node-b"].status) == (1, 202, 9)
    assert (got["node-a"].rank, got["node-a"].status) == (0, wait_status(1)) == (0, 256)


def test_a_new_launch_forgets_the_old_one_and_a_machine_lost_whole_is_read_from_pdsh(tmp_path):
    log = tmp_path / "launcher.log"
    log.write_text(RUNNER + node("node-a", MAPPING, 1) + node("node-b", MAPPING, 2) + failed("node-b", -9)
                   + RUNNER + node("node-a", MAPPING, 3) + node("node-b", MAPPING, 4)
                   + "pdsh@here: node-b: ssh exited with exit code 255\n")
    (only,) = RemoteLog(log).poll()
    assert (only.host, only.rank, only.pid, only.status) == ("node-b", 1, 4, 255 << 8)


def test_several_ranks_on_the_failing_machine_name_the_machine_only(tmp_path):
    log = tmp_path / "launcher.log"
    mapping = "{'node-a': [0, 1], 'node-b': [2, 3]}"
    log.write_text(RUNNER + node("node-a", mapping, 1) + node("node-b", mapping, 2) + failed("node-b", -9))
    (only,) = RemoteLog(log).poll()
    assert (only.host, only.rank) == ("node-b", None)


FAILED_BY_GLOO = Facts(now=10.0, state=RunState.FAILED, error="RuntimeError: Connection closed by peer",
                       error_rank=0, alive=True, seen_alive=True, launcher_alive=True, final_since=9.5,
                       remote=True)


def test_the_killed_remote_rank_is_blamed_over_the_run_s_own_report():
    reporter = RankExit(0, 101, wait_status(1), 9.6, "node-a")
    killed = RankExit(1, 202, wait_status(-9), 9.7, "node-b")
    verdict = judge(dataclasses.replace(FAILED_BY_GLOO, exits=(reporter, killed)))
    assert (verdict.kind, verdict.rank) == (VerdictKind.RANK_DIED, 1)
    assert verdict.message([]).startswith("rank 1 on host node-b (pid 202) ended with signal SIGKILL; "
                                          "the run then reported: RuntimeError")


def test_the_run_s_report_waits_for_the_other_machines():
    assert judge(FAILED_BY_GLOO) is None  # until the launchers (polling each second) have ended
    late = dataclasses.replace(FAILED_BY_GLOO, now=9.5 + LINGER_GRACE_S + 0.1)
    assert (judge(late).kind, judge(late).rank) == (VerdictKind.ERROR, 0)
    gone = dataclasses.replace(FAILED_BY_GLOO, launcher_alive=False)  # all told: no more to wait for
    assert judge(gone).rank == 0


def test_a_remote_rank_that_exited_with_a_code_does_not_override_the_report():
    other = RankExit(1, 202, wait_status(1), 9.7, "node-b")  # it saw the same failure and exited
    verdict = judge(dataclasses.replace(FAILED_BY_GLOO, exits=(other,), launcher_alive=False))
    assert (verdict.kind, verdict.rank) == (VerdictKind.ERROR, 0)
