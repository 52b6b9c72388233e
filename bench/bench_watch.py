"""What watching costs training: steps/s of one run of the embedded default with no page open,
with the Train tab open and with the Chat tab open, in a real browser (Debian's Chromium).

    .venv/bin/python bench/bench_watch.py [--window 25] [--rounds 2] [--app-repo PATH]

One run trains throughout (periodic evaluation off, so its speed is steady); the script cycles
through the three cases `--rounds` times, each for `--window` seconds after the page has
settled, and takes the speed from the run's own records (events.jsonl: step and time) inside
each window. Cycling the cases spreads the machine's own drift over all three. Prints a
Markdown table: median steps/s per case and its ratio to no page (target: >= 0.95), and the
CPU the app server and the browser used meanwhile (on a shared machine the steps/s are noisy;
the CPU used is what watching takes from training).
`--app-repo` serves the app from another checkout (an older commit, to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_web import ARGS, free_port, serve, train_records  # noqa: E402

CASES = ("no page", "Train tab open", "Chat tab open")


def rate(events: Path, since: float, until: float) -> float:
    """Steps per second over the train records written between `since` and `until`."""
    inside = [(s, t) for s, t in train_records(events) if since <= t <= until]
    if len(inside) < 2:
        return 0.0
    return (inside[-1][0] - inside[0][0]) / max(1e-9, inside[-1][1] - inside[0][1])


def cpu_seconds(app_pid: int) -> tuple[float, float]:
    """CPU seconds used so far by the app server itself (not the runs it started) and by the
    browser (every process this script started other than the app and its children)."""
    import psutil

    def used(proc: "psutil.Process") -> float:
        try:
            t = proc.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    app = psutil.Process(app_pid)
    app_family = {app_pid} | {c.pid for c in app.children(recursive=True)}
    browser = [c for c in psutil.Process().children(recursive=True) if c.pid not in app_family]
    return used(app), sum(used(c) for c in browser)


def open_page(browser, url: str, tab: str):
    """A fresh page on the app, settled on `tab` (the app opens on Train for a run going)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(url)
    page.wait_for_function("() => { const s = document.querySelector('#run-state');"
                           " return s && /running/.test(s.innerText); }", timeout=120_000)
    page.wait_for_function("() => document.querySelector('#train-plot-loss svg path') !== null", timeout=120_000)
    if tab != "Train":
        page.get_by_role("tab", name=tab, exact=True).first.click()
    time.sleep(3)  # the page's own start-up is not what is measured
    return context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=25.0, help="seconds each case is measured")
    parser.add_argument("--rounds", type=int, default=2, help="times the three cases are cycled")
    parser.add_argument("--app-repo", type=Path, default=REPO, help="checkout to serve the app from")
    args = parser.parse_args()
    from gradio_client import Client
    from playwright.sync_api import sync_playwright

    import bench.bench_web as web
    web.REPO = args.app_repo.resolve()  # serve() runs `python -m app` there
    root = Path(tempfile.mkdtemp(prefix="bench-watch-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    app = serve(root / "runs", port, root / "app.log")
    results: dict[str, list[float]] = {case: [] for case in CASES}
    cpu: dict[str, list[tuple[float, ...]]] = {case: [] for case in CASES}  # (app, browser) cores busy
    try:
        client = Client(url, verbose=False)
        config = {"train": {"max_steps": 1_000_000}, "eval": {"every_n_steps": 0, "at_end": False},
                  "checkpoint": {"save_at_end": False, "every_n_steps": 0},
                  "logging": {"run_name": "watch", "tensorboard": False}}
        client.predict(config=json.dumps(config), preset="embedded default", api_name="/start")
        events = root / "runs" / "watch" / "events.jsonl"
        deadline = time.monotonic() + 600
        while client.predict(run="watch", api_name="/status")["step"] < 20:
            if time.monotonic() > deadline:
                raise SystemExit("the run did not start training within 600 s")
            time.sleep(2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=ARGS)
            for _ in range(args.rounds):
                for case in CASES:
                    context = None
                    if case != "no page":
                        context = open_page(browser, url, "Train" if case.startswith("Train") else "Chat")
                    else:
                        time.sleep(3)
                    since, cpu_before = time.time(), cpu_seconds(app.pid)
                    time.sleep(args.window)
                    results[case].append(rate(events, since, time.time()))
                    cpu_after = cpu_seconds(app.pid)
                    cpu[case].append(tuple((b - a) / args.window for a, b in zip(cpu_before, cpu_after)))
                    status = client.predict(run="watch", api_name="/status")
                    if not status["alive"]:  # e.g. ended from outside: the numbers would mean nothing
                        raise SystemExit(f"the run ended during the benchmark: {status['state']} {status['error']}")
                    if context is not None:
                        context.close()
            browser.close()
        client.predict(run="watch", save=False, api_name="/stop")
    finally:
        app.send_signal(signal.SIGINT)
        try:
            app.wait(timeout=30)
        except subprocess.TimeoutExpired:
            app.kill()
        for pid_file in (root / "runs").glob("*/launcher.pid"):
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    base = statistics.median(results["no page"]) or 1e-9
    print(f"\nembedded default, {args.rounds} x {args.window:g} s per case, app from {args.app_repo}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| case | steps/s (median) | each window | vs no page | app server CPU | browser CPU |")
    print("|---|---|---|---|---|---|")
    for case in CASES:
        values = results[case]
        median = statistics.median(values) if values else 0.0
        app_cpu = statistics.mean(c[0] for c in cpu[case]) if cpu[case] else 0.0
        browser_cpu = statistics.mean(c[1] for c in cpu[case]) if cpu[case] else 0.0
        print(f"| {case} | {median:.2f} | {', '.join(f'{v:.2f}' for v in values)} | {median / base:.2f} | "
              f"{100 * app_cpu:.0f}% of a core | {100 * browser_cpu:.0f}% of a core |")
    print("\nCPU: the mean share of one core each used during the windows (what watching takes from "
          "training on a machine whose cores are all busy).")


if __name__ == "__main__":
    main()
