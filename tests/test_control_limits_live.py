"""A live 2-rank run of the tiny default model under hostile and careless clients: no listener
beyond loopback, 100 clients leave no thread behind on rank 0, hostile messages and an overlong
prompt are refused at once, four event viewers that never read hold neither training nor stop.

Throughput under attack is measured by bench/bench_control_limits.py, not asserted here (a
ratio of two timings on a shared machine would make CI red for nothing).
"""

import ipaddress
import json
import socket
import time

import psutil
import pytest

from supervisor.client import RunClient
from control_runs import events, launch, logs_of, states, task_files, wait_exit, wait_for_step


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return task_files(tmp_path_factory.mktemp("task"))


def listening(root_pid: int) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening socket of the process `root_pid` and its children."""
    root = psutil.Process(root_pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            found += [(proc.pid, c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return found


def send(address: dict, payload: bytes) -> dict:
    with socket.create_connection((address["host"], address["port"]), timeout=60) as sock:
        sock.sendall(payload + b"\n")
        return json.loads(sock.makefile("rb").readline())


def stuck_viewer(address: dict) -> socket.socket:
    """A subscriber from line 0 that never reads (a tiny receive window: it fills at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((address["host"], address["port"]))
    sock.sendall(json.dumps({"token": address["token"], "id": "viewer", "cmd": "subscribe",
                             "args": {"from_line": 0}}).encode() + b"\n")
    return sock


@pytest.mark.slow
def test_live_run_under_hostile_clients(tmp_path, task):
    run = launch(tmp_path, "limits", task, "max_steps=100000", "optim.scheduler=constant",  # stopped by the test
                 "optim.warmup_steps=0")
    client = RunClient.connect(run.folder.root, timeout=180)
    wait_for_step(run, 2)
    address = json.loads(run.folder.control.read_text())

    # on one machine no socket of the run listens beyond loopback (store, gloo, control server)
    sockets = listening(run.pid)
    assert any(port == address["port"] for _, _, port in sockets), sockets
    assert all(ipaddress.ip_address(ip).is_loopback for _, ip, _ in sockets), sockets

    # 100 clients connect, ask for status and leave: rank 0 has no more threads than before
    rank0 = psutil.Process(address["pid"])
    threads_before = rank0.num_threads()
    for _ in range(100):
        with RunClient.connect(run.folder.root, timeout=60) as one:
            assert one.status().state == "running"
    deadline = time.monotonic() + 60
    while client.status().control["connections"] > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.status().control["connections"] == 1
    # (+2: room for a thread torch may start late; a thread per client would be +100)
    assert rank0.num_threads() <= threads_before + 2, (threads_before, rank0.num_threads())

    # hostile messages and an overlong prompt: an error answer each, nothing queued
    token = address["token"]
    big_lr = json.dumps({"token": token, "id": "big", "cmd": "set", "args": {"lr": 10**400}}).encode()
    assert send(address, big_lr)["type"] == "error"
    assert send(address, b"[" * 100_000 + b"]" * 100_000)["type"] == "error"
    long_prompt = json.dumps({"token": token, "id": "long", "cmd": "generate",
                              "args": {"prompt": "a" * 100_000}}).encode()
    answer = send(address, long_prompt)
    assert answer["type"] == "error" and "context of 256 tokens" in answer["message"], answer

    # four viewers that never read: training goes on, and stop does not wait for them
    viewers = [stuck_viewer(address) for _ in range(4)]
    step = wait_for_step(run, 3)
    wait_for_step(run, step + 5)
    deadline = time.monotonic() + 60
    while client.status().control["connections"] < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.status().control["connections"] == 5  # the viewers are still connected
    stopped = client.stop(save=False)
    # the stuck viewers hold nothing up: the server closes and the run exits (a hang would run
    # into wait_exit's timeout; how fast is bench/bench_control_limits.py's business)
    assert wait_exit(run, timeout=120) == 0, logs_of(run)
    assert not run.folder.control.exists()
    for sock in viewers:
        sock.close()
    client.close()
    assert stopped.state == "stopping" and states(run)[-1] == "finished"
    assert not [e for e in events(run) if e["type"] == "command" and e["id"] in ("big", "long")]
