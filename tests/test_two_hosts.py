"""Two machines for real, on this one: two network namespaces with their own host names and ssh
servers (tests/hosts.py), a DeepSpeed hostfile naming both, pdsh over ssh starting one rank on
each, gloo between them over the veth, and the run folder on the file system both see (the
shared file system of a cluster).

What it shows, through the supervisor as every front end uses it:
- the run trains across both hosts, and its losses are the same 2-rank run's on one host;
- rank 0's control socket, opted into on host a's address, answers a chat from host b (the
  token still needed), pauses, sets the learning rate; the web app's backend lists the run and
  shows its live settings;
- Stop leaves no process on either host;
- host b lost once (its rank killed with SIGKILL, the run paused past a saved checkpoint) with
  `fault.max_restarts=1`: reported within seconds naming rank 1 and host b, the group relaunched
  over both hosts from that checkpoint, the steps after it trained again with the same losses
  bit for bit, and the run finishes.

The figures the README quotes (tokens/s of both runs, chat first-token latency over the veth and
over loopback) are printed as `FIGURE ...` lines (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.run_folder import read_events
from hosts import HostsUnavailable, TwoHosts, check_available, cmdline, in_host, two_hosts
from control_runs import task_files
from supervisor.client import RunClient
from supervisor.manager import RunManager

pytestmark = pytest.mark.slow

STEPS = 40        # both runs' schedule (the lr schedule depends on it)
DEADLINE_S = 400  # liveness on a loaded machine: generous


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> TwoHosts:
    try:
        check_available()
    except HostsUnavailable as e:
        pytest.skip(f"two hosts cannot be made here: {e}")
    with two_hosts(tmp_path_factory.mktemp("hosts")) as made:
        yield made


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    return task_files(tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="module")
def decoy(tmp_path_factory):
    """Another DeepSpeed launch on the machine, not ours: a process whose command line is
    `<python> -u -m deepspeed.launcher.launch ...` (a stand-in package that only sleeps). It must
    outlive every stop and failure of the runs here: DeepSpeed's multi-node runner, on SIGTERM,
    pkills every such command line on every host (supervisor/remote_stop.py), so the supervisor
    must never SIGTERM it."""
    fake = tmp_path_factory.mktemp("decoy")
    (fake / "deepspeed" / "launcher").mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text("")
    (fake / "deepspeed" / "launcher" / "__init__.py").write_text("")
    (fake / "deepspeed" / "launcher" / "launch.py").write_text("import time\ntime.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-u", "-m", "deepspeed.launcher.launch", "--world_info=not-ours"],
                            env={**os.environ, "PYTHONPATH": str(fake)}, start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def config(runs: Path, name: str, task: dict, *overrides: str):
    return load_config(overrides=[
        f"output_dir={runs}", f"run_name={name}", f"max_steps={STEPS}", "batch_size=8",
        "data.max_length=32", f"data.train={task['train']}", f"data.eval={task['eval']}", "precision=fp32",
        "logging.tensorboard=false", "checkpoint.save_at_end=false", "eval.at_end=false",
        "optim.warmup_steps=3", *overrides])


def host_env(net: TwoHosts) -> dict[str, str]:
    """The launcher's environment: the test's ssh first on PATH, and one thread per rank: both
    "hosts" share this machine's cores, as the one-host run's 2 ranks do (carried to the ranks
    through the run's deepspeed_env)."""
    return {**net.env, "OMP_NUM_THREADS": "1"}


def two_host_config(net: TwoHosts, runs: Path, name: str, task: dict, *overrides: str):
    a = net.hosts[0]
    return config(runs, name, task, "nproc=1", f"parallel.hostfile={net.hostfile(runs.parent / 'hostfile')}",
                  f"parallel.master_addr={a.address}", f"control.host={a.address}", *overrides)


def train_events(folder: Path) -> list[dict]:
    return [e for e in read_events(folder / "events.jsonl") if e["type"] == "train"]


def wait_until(what: str, check, timeout: float = DEADLINE_S, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(every)
    pytest.fail(f"{what}: not within {timeout} s")


def wait_step(handle, step: int) -> None:
    def reached():
        info = handle.info()
        assert info.alive or info.step >= step, f"run ended early: {info.state} {info.error}"
        return info.step >= step
    wait_until(f"run {handle.name} reaching step {step}", reached)


def reaches_step(handle, step: int) -> bool:
    """Whether the run reaches `step` (False: it ended before)."""
    def reached():
        info = handle.info()
        return "yes" if info.step >= step else ("no" if not info.alive and info.state != "starting" else None)
    return wait_until(f"run {handle.name} reaching step {step}", reached) == "yes"


def first_token_s(client: RunClient, repeats: int = 5) -> float:
    """Median seconds from sending a chat to its first streamed piece (the run paused: a chat
    is answered at once, not at the next step boundary)."""
    times = []
    for seed in range(repeats):
        t0 = time.perf_counter()
        first = None
        for _ in client.generate("Hello", max_new_tokens=4, temperature=1.0, seed=seed + 1):
            first = first if first is not None else time.perf_counter()
        assert first is not None, "the chat streamed nothing"
        times.append(first - t0)
    return statistics.median(times)


def tokens_per_s(events: list[dict], last_step: int) -> float:
    """Median real tokens/s of the steps after the first, up to `last_step` (all replicas)."""
    rates = [e["tokens_per_s"] for e in events if 1 < e["step"] <= last_step]
    return statistics.median(rates)


def run_processes(net: TwoHosts, run_dir: Path) -> dict[str, list[str]]:
    """Processes of the run (their command names the run folder) on each host."""
    return {h.name: [cmdline(p) for p in net.processes(h) if str(run_dir) in cmdline(p)] for h in net.hosts}


def refused_without_token(host: str, port: int) -> dict:
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b'{"id": "x", "cmd": "status", "args": {}, "token": "not-the-token"}\n')
        return json.loads(s.makefile().readline())


@pytest.fixture(scope="module")
def one_host(tmp_path_factory, task) -> dict:
    """The same run on one host, 2 ranks, control on loopback: its losses, tokens/s and chat latency."""
    runs = tmp_path_factory.mktemp("one-host")
    manager = RunManager(runs)
    handle = manager.start(config(runs, "one", task, "nproc=2"))
    try:
        if not reaches_step(handle, 3):
            # once more: DeepSpeed's CPU shared-memory all-reduce (used by ranks on one host only)
            # can fault at start-up when another test session on the machine removes
            # /dev/shm/deepspeed_allreduce_buffer_* files (tests/conftest.py does, by age)
            handle = manager.start(config(runs, "one-again", task, "nproc=2"))
            wait_step(handle, 3)
        with RunClient.connect(handle.folder.root, timeout=DEADLINE_S) as client:
            client.pause()
            latency = first_token_s(client)
            client.resume()
        assert manager.wait(handle.name, timeout=DEADLINE_S)
        assert handle.info().state == "finished", handle.failure()
    finally:
        manager.stop(handle.name, save=False)
    events = train_events(handle.folder.root)
    return {"losses": {e["step"]: e["loss"] for e in events}, "lrs": {e["step"]: e["lr"] for e in events},
            "tokens_per_s": tokens_per_s(events, STEPS),
            "first_token_s": latency}


def test_two_hosts_train_chat_pause_set_lr_and_stop(net, task, one_host, tmp_path, decoy):
    a, b = net.hosts
    runs = tmp_path / "runs"
    manager = RunManager(runs)
    with in_host(a):  # started on host a, as its user would: ./launch.sh train with the hostfile
        handle = manager.start(two_host_config(net, runs, "two", task), env=host_env(net))
    try:
        wait_step(handle, 1)
        address = json.loads(handle.folder.control.read_text())
        assert address["host"] == a.address
        assert (handle.folder.control.stat().st_mode & 0o777) == 0o600
        with in_host(b):  # everything below crosses the veth, from host b
            refused = refused_without_token(address["host"], address["port"])
            assert refused["type"] == "error" and "token" in refused["message"], refused
            with RunClient.connect(handle.folder.root, timeout=60) as client:
                assert client.pause().state == "paused"
                latency = first_token_s(client)
                status = client.status()
                assert status.state == "paused" and status.world_size == 2
                changed = client.set(lr=2e-4)
                assert changed.changes["lr"] == pytest.approx(2e-4)
                lr_step = changed.step
                web_view = web_app_view(runs, handle.folder.root)
                assert web_view["state"] == "paused" and web_view["settings"]["lr"] == pytest.approx(2e-4)
                assert client.resume().state == "running"
                wait_step(handle, lr_step + 1)
                assert client.pause().state == "paused"  # stopped while paused: STEPS not reached
            stopped = manager.stop(handle.name, save=False, timeout=120)
        assert stopped.state == "finished" and stopped.stopped_by_user, stopped
        wait_until("no process of the run left on either host",
                   lambda: not any(run_processes(net, handle.folder.root).values()), timeout=60)
    finally:
        with in_host(b):
            manager.stop(handle.name, save=False, timeout=30)
    assert decoy.poll() is None, "the stop ended another DeepSpeed launch on the machine"
    launcher = (handle.folder.logs / "launcher.log").read_text()
    assert f"{a.name}: " in launcher and f"{b.name}: " in launcher  # pdsh started a rank on each
    assert f"'{a.name}': [0], '{b.name}': [1]" in launcher
    events = train_events(handle.folder.root)
    got = {e["step"]: e["loss"] for e in events}
    assert lr_step >= 1 and max(got) < STEPS
    for step in range(1, lr_step + 1):  # up to the lr change, the same trajectory as on one host
        assert got[step] == pytest.approx(one_host["losses"][step], rel=1e-5), step
    # set lr scales the schedule from then on: the same factor on every later step, below 1
    # (2e-4 is under the schedule's rate at any step after the first warm-up step)
    scale = [e["lr"] / one_host["lrs"][e["step"]] for e in events if e["step"] > lr_step + 1]
    assert scale and all(f == pytest.approx(scale[0], rel=1e-6) for f in scale) and scale[0] < 0.99, scale
    two_rate = tokens_per_s(events, max(got))
    print(f"\nFIGURE two-host tokens/s {two_rate:.0f} vs one-host 2 ranks {one_host['tokens_per_s']:.0f} "
          f"({two_rate / one_host['tokens_per_s']:.2f}x)")
    print(f"FIGURE chat first token over the veth {latency * 1e3:.0f} ms vs loopback "
          f"{one_host['first_token_s'] * 1e3:.0f} ms (medians of 5, paused runs)")
    print(f"FIGURE losses equal to one host's up to step {lr_step}: "
          f"{'exactly' if all(got[s] == one_host['losses'][s] for s in range(1, lr_step + 1)) else 'within 1e-5'}")


def web_app_view(runs: Path, run_dir: Path) -> dict:
    """What the web app's backend, pointed at the runs folder, shows of the run (its listing and
    the status its pages poll, live settings included)."""
    from app.web.backend import Backend  # the web app's own backend (Gradio-free objects)
    backend = Backend(runs)
    try:
        listed = {info.name: info for info in backend.session.runs()}
        assert run_dir.name in listed and listed[run_dir.name].alive
        return backend.watch.status(str(run_dir))
    finally:
        backend.close()


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _losses(events: list[dict]) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in events if e["type"] == "train"]


def _after_restart(events: list[dict]) -> list[dict]:
    at = [i for i, e in enumerate(events) if e["type"] == "restart"]
    return events[at[-1] + 1:] if at else []


def rank_on(net: TwoHosts, host, run_dir: Path) -> list[int]:
    """Pids of the run's rank processes living on `host`."""
    return [p for p in net.processes(host) if "-m engine.worker" in cmdline(p) and str(run_dir) in cmdline(p)]


def run_pids(net: TwoHosts, run_dir: Path) -> set[int]:
    """Pids of the run's processes on both hosts."""
    return {p for h in net.hosts for p in net.processes(h) if str(run_dir) in cmdline(p)}


def test_a_lost_host_b_is_reported_and_the_run_restarts_over_both_hosts(net, task, tmp_path, decoy, monkeypatch):
    """Host b's rank is killed with SIGKILL (what its host's loss looks like to the launcher: the
    rank's process gone, its launcher's report; a cut network would look like a hang, which is
    reported, not restarted). Where it dies is set by the run's own pauses, not by the machine's
    speed: a checkpoint saved while paused at step p, training on, paused again at q > p, the kill
    there. The failure is reported within seconds naming rank 1 and host b; the manager (on host
    a, as its front end would be) ends what is left on both hosts, relaunches the group over both
    from step p, the steps p+1..q trained again repeat the first attempt's losses exactly, and a
    stop after them finishes the run, leaving no process on either host."""
    a, b = net.hosts
    runs = tmp_path / "runs"
    manager = RunManager(runs)
    reported = []
    seen = threading.Event()
    # a variable of the launching shell that DeepSpeed's runner would not carry on a CPU machine
    monkeypatch.setenv("NCCL_LIVETUNE_PROBE", "forwarded to every host")
    # what a process that ran a one-machine run in-process holds (engine.parallel.rendezvous): not carried
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with in_host(a):  # the manager's monitor (and the relaunch it makes) lives on host a
        manager.start_monitor(interval=0.3,
                              on_failure=lambda f: (reported.append((time.monotonic(), f)), seen.set()))
        handle = manager.start(two_host_config(net, runs, "killed", task, "max_steps=100000",
                                               "fault.max_restarts=1", "control.enabled=true"),
                               env=host_env(net))
    root = handle.folder.root
    try:
        wait_step(handle, 2)
        (rank1,) = rank_on(net, b, root)
        remote = environ(rank1)  # the rank on host b, started there by pdsh over ssh
        assert remote.get("NCCL_LIVETUNE_PROBE") == "forwarded to every host", sorted(remote)
        assert remote.get("OMP_NUM_THREADS") == "1"  # the launching environment's own setting
        assert "GLOO_SOCKET_IFNAME" not in remote  # ranks on two machines cannot meet on loopback
        with in_host(a), RunClient.connect(root, timeout=DEADLINE_S) as client:
            saved_at = client.pause().step
            saved = client.save()
            client.resume()
            wait_step(handle, saved_at + 3)
            killed_at = client.pause().step
        first = run_pids(net, root)
        killed = time.monotonic()
        os.kill(rank1, 9)
        assert seen.wait(DEADLINE_S), "the lost rank was not reported"  # a bound on a hang only
        when, failure = reported[0]
        assert failure.rank == 1 and f"on host {b.name}" in failure.message, failure
        assert "SIGKILL" in failure.message, failure
        print(f"\nFIGURE kill -9 of the remote rank reported after {when - killed:.1f} s: {failure.message[:160]}")
        # the relaunched group trains past the step it died at, a rank on each host
        wait_until("the relaunched group training past the kill", lambda: any(
            s > killed_at for s, _ in _losses(_after_restart(list(read_events(root / "events.jsonl"))))))
        assert rank_on(net, a, root) and rank_on(net, b, root)
        assert not first & run_pids(net, root), "a process of the first attempt outlived the failure"
        with in_host(a):
            stopped = manager.stop(handle.name, save=False, timeout=120)
        wait_until("no process of the run left on either host",
                   lambda: not any(run_processes(net, root).values()), timeout=60)
    finally:
        manager.close()
        with in_host(a):
            manager.stop(handle.name, save=False, timeout=30)
    # what was left of the run was ended by its run folder, not by DeepSpeed's pkill of every
    # launch on the machine
    assert decoy.poll() is None, "ending the failed run ended another DeepSpeed launch"
    assert stopped.state == "finished" and stopped.stopped_by_user, stopped
    events = list(read_events(root / "events.jsonl"))
    (failed,) = [e for e in events if e["type"] == "rank_failed"]
    (restarted,) = [e for e in events if e["type"] == "restart"]
    assert failed["rank"] == 1 and f"on host {b.name}" in failed["error"] and "SIGKILL" in failed["error"], failed
    assert restarted["attempt"] == 1 and restarted["checkpoint"].endswith(f"step-{saved_at}")
    assert saved.step == saved_at and killed_at >= saved_at + 3
    cut = events.index(restarted)
    before, after = dict(_losses(events[:cut])), _losses(events[cut:])
    assert [s for s, _ in after] == list(range(saved_at + 1, after[-1][0] + 1))  # from the checkpoint on
    repeated = range(saved_at + 1, killed_at + 1)
    assert all(dict(after)[s] == before[s] for s in repeated), (before, after)
    print(f"FIGURE steps {saved_at + 1}..{killed_at} trained again after the restart: losses equal bit for bit")
