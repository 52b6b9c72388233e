"""The control server under careless and hostile clients, on a live 2-rank run of the tiny
default model (ZeRO-2). Run by hand:

    .venv/bin/python bench/bench_control_limits.py [--window 30] [--repeats 3] [--clients 1000]

1. Steps/s with 4 event viewers that never read against none: one run, windows of `window`
   steps without and with the viewers, `repeats` pairs, the order swapped every pair (the
   machine's load drifts); medians, rank 0's CPU seconds per step and the control-server
   thread's share of them (less swayed by other load than steps/s), and rank 0's send buffers.
2. Rank 0's thread count and memory (RSS) before and after `clients` sequential clients that
   connect, ask for status and close.
3. A burst of 200 connections opened at once: how many were served and how many refused.
4. What a chat costs: the run's own record (`seconds` of each done generate) of chats asking for
   4096 new tokens (capped by the context), against the step time.
5. Stop with 4 stuck viewers: seconds from the stop's answer to the server's close (control.json
   gone) and to the end of every process of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from supervisor.client import RunClient  # noqa: E402
from control_runs import events, launch, task_files, wait_exit  # noqa: E402
from contract.run_folder import EventTail  # noqa: E402


def newest_step(tail: EventTail, done: int) -> int:
    return max([done] + [e["step"] for e in tail.poll() if e.get("type") == "train"])


def window(run, tail: EventTail, steps: int) -> float:
    """Steps per second over the next `steps` steps (the event log's clock)."""
    start = done = newest_step(tail, window.done)
    while start == 0:  # no step logged yet
        time.sleep(0.25)
        start = done = newest_step(tail, 0)
    while done < start + steps:
        time.sleep(0.25)
        done = newest_step(tail, done)
    window.done = done
    train = {e["step"]: e["time"] for e in events(run) if e["type"] == "train"}
    return (done - start) / (train[done] - train[start])


window.done = 0  # the newest step seen (the tail hands each line over once)


def cpu_s(proc: psutil.Process) -> float:
    """CPU seconds the process has used: less swayed by other load than wall-clock steps/s."""
    times = proc.cpu_times()
    return times.user + times.system


def server_cpu_s(client: RunClient) -> float:
    """CPU seconds rank 0's control-server thread has used (its own account, in status)."""
    return client.status().control["cpu_s"]


def stuck_viewer(address: dict) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((address["host"], address["port"]))
    sock.sendall(json.dumps({"token": address["token"], "id": "viewer", "cmd": "subscribe",
                             "args": {"from_line": 0}}).encode() + b"\n")
    return sock


def burst(address: dict, n: int = 200) -> tuple[int, int, int]:
    """n connections opened at once, each asking for status: (served, refused, failed)."""
    outcomes: list = [None] * n
    opened, leave = threading.Barrier(n), threading.Barrier(n)
    line = json.dumps({"token": address["token"], "id": 1, "cmd": "status"}).encode() + b"\n"

    def one(i: int) -> None:
        try:
            with socket.create_connection((address["host"], address["port"]), timeout=60) as sock:
                opened.wait(60)
                sock.sendall(line)
                outcomes[i] = json.loads(sock.makefile("rb").readline())["type"]
                leave.wait(60)
        except Exception as e:  # noqa: BLE001 - counted as a failure
            outcomes[i] = type(e).__name__

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes.count("done"), outcomes.count("error"), n - outcomes.count("done") - outcomes.count("error")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=30, help="steps per window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--chats", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-limits-") as tmp_dir:
        tmp = Path(tmp_dir)
        task = task_files(tmp / "task")
        run = launch(tmp, "limits", task, "zero_stage=2", "max_steps=100000",
                     "optim.scheduler=constant", "optim.warmup_steps=0")
        client = RunClient.connect(run.folder.root, timeout=300)
        address = json.loads(run.folder.control.read_text())
        rank0 = psutil.Process(address["pid"])
        tail = EventTail(run.folder.events)
        window(run, tail, 10)  # warm-up

        clean, stuck, buffered, cpu_clean, cpu_stuck, srv_clean, srv_stuck = [], [], [], [], [], [], []
        for r in range(args.repeats):
            for with_viewers in ((False, True) if r % 2 == 0 else (True, False)):  # turn about
                viewers = [stuck_viewer(address) for _ in range(4 if with_viewers else 0)]
                cpu, srv = cpu_s(rank0), server_cpu_s(client)
                steps_s = window(run, tail, args.window)
                per_step = ((cpu_s(rank0) - cpu) / args.window, (server_cpu_s(client) - srv) / args.window)
                if with_viewers:
                    stuck.append(steps_s)
                    cpu_stuck.append(per_step[0])
                    srv_stuck.append(per_step[1])
                    buffered.append(client.status().control["buffered_bytes"])
                else:
                    clean.append(steps_s)
                    cpu_clean.append(per_step[0])
                    srv_clean.append(per_step[1])
                for sock in viewers:
                    sock.close()

        threads0, rss0 = rank0.num_threads(), rank0.memory_info().rss
        started = time.perf_counter()
        for _ in range(args.clients):
            with RunClient.connect(run.folder.root, timeout=60) as one:
                one.status()
        clients_s = time.perf_counter() - started
        while client.status().control["connections"] > 1:
            time.sleep(0.1)
        threads1, rss1 = rank0.num_threads(), rank0.memory_info().rss

        served, refused, failed = burst(address)

        step_s = 1 / statistics.median(clean)
        for i in range(args.chats):
            client.generate(f"reverse: w{i}ord\n", max_new_tokens=4096, temperature=1.0, seed=i).wait()
        chats = [e for e in events(run) if e["type"] == "command" and e["cmd"] == "generate"
                 and e["status"] == "done"]
        chat_s = max(e["seconds"] for e in chats)
        # the default tokenizer is character-level: an answer's length is its token count
        per_token_s = statistics.median(e["seconds"] / max(1, len(e["result"]["text"])) for e in chats)
        answer_chars = [len(e["result"]["text"]) for e in chats]
        queued = [e for e in events(run) if e["type"] == "command" and e["cmd"] == "generate"
                  and e["status"] == "queued"]
        capped = {e["args"].get("max_new_tokens") for e in queued}

        viewers = [stuck_viewer(address) for _ in range(4)]
        time.sleep(1.0)
        client.stop(save=False)
        answered = time.monotonic()
        while run.folder.control.exists():
            time.sleep(0.01)
        closed_s = time.monotonic() - answered
        wait_exit(run, timeout=120)
        ended_s = time.monotonic() - answered
        for sock in viewers:
            sock.close()

    print(f"\ncontrol server limits: 2 ranks, tiny default model, ZeRO-2; load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print(f"steps/s, {args.repeats} x {args.window}-step windows turn about: no viewers "
          f"{statistics.median(clean):.2f} ({', '.join(f'{x:.2f}' for x in clean)}), 4 stuck viewers "
          f"{statistics.median(stuck):.2f} ({', '.join(f'{x:.2f}' for x in stuck)}): ratio "
          f"{statistics.median(stuck) / statistics.median(clean):.3f}; rank 0 send buffers then "
          f"{max(buffered)} bytes")
    print(f"rank 0 CPU seconds per step (less swayed by other load): no viewers "
          f"{statistics.median(cpu_clean) * 1e3:.1f} ms, 4 stuck viewers {statistics.median(cpu_stuck) * 1e3:.1f} ms; "
          f"of it the control-server thread: {statistics.median(srv_clean) * 1e3:.2f} ms and "
          f"{statistics.median(srv_stuck) * 1e3:.2f} ms")
    print(f"{args.clients} sequential clients (connect, status, close) in {clients_s:.1f} s: rank 0 "
          f"threads {threads0} -> {threads1}, RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB")
    print(f"200 connections at once: {served} served, {refused} refused with a message, {failed} failed")
    cap = max(c for c in capped if c)
    print(f"chats of max_new_tokens=4096 (capped to {cap} by the context): answers of {answer_chars} "
          f"tokens, longest {chat_s:.3f} s = {chat_s / step_s:.1f} steps (step {step_s * 1e3:.1f} ms); "
          f"{per_token_s * 1e3:.2f} ms per token, so a full {cap}-token answer costs about "
          f"{cap * per_token_s / step_s:.1f} steps")
    print(f"stop with 4 stuck viewers: server closed {closed_s:.2f} s after the answer, every "
          f"process gone after {ended_s:.2f} s")


if __name__ == "__main__":
    main()
