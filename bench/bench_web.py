"""Web app latency, measured with a real browser while a 2-rank run of the embedded default trains.

    .venv/bin/python bench/bench_web.py [--loads 5] [--watch 60] [--steps 200]

1. Page load to interactive: a fresh browser context opens the app (no cache) while the run
   trains; "interactive" is when the page shows the run's state and its loss plot has drawn the
   history so far (the app opens on the Train tab of the run going on). Target: < 2 s.
2. Step to plot: for each training step, the time from the run writing its record to
   events.jsonl (the record's own `time`) to the browser's loss plot drawing a point for it
   (a MutationObserver on the plot's SVG, timestamps from the same machine clock). Target: < 3 s.

Prints a Markdown table. Uses Debian's Chromium (`chromium` on PATH), never a downloaded one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
POINTS_JS = """() => Math.max(0, ...Array.from(document.querySelectorAll('#train-plot-loss svg path'))
    .map(p => ((p.getAttribute('d') || '').match(/[ML]/g) || []).length))"""
WATCH_JS = """() => { window.plotLog = []; const el = document.querySelector('#train-plot-loss');
    const count = () => Math.max(0, ...Array.from(el.querySelectorAll('svg path'))
        .map(p => ((p.getAttribute('d') || '').match(/[ML]/g) || []).length));
    new MutationObserver(() => window.plotLog.push([Date.now() / 1000, count()]))
        .observe(el, {subtree: true, childList: true, attributes: true}); }"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(runs: Path, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "app", "--port", str(port), "--output-dir", str(runs)],
                            cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}", timeout=5)
            return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(1)
    proc.kill()
    raise SystemExit("the app did not start:\n" + log.read_text()[-2000:])


def train_records(events: Path) -> list[tuple[int, float]]:
    out = []
    for line in events.read_text().splitlines():
        event = json.loads(line)
        if event.get("type") == "train":
            out.append((event["step"], event["time"]))
    return out


def page_loads(browser, url: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        started = time.perf_counter()
        page.goto(url)
        page.wait_for_function("() => { const s = document.querySelector('#run-state');"
                               " return s && /running|paused/.test(s.innerText); }", timeout=120_000)
        page.wait_for_function(f"() => ({POINTS_JS})() >= 2", timeout=120_000)
        times.append(time.perf_counter() - started)
        context.close()
    return times


def step_latencies(browser, url: str, events: Path, watch_s: float) -> list[float]:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.wait_for_function(f"() => ({POINTS_JS})() >= 2", timeout=120_000)
    page.evaluate(WATCH_JS)
    first_step = train_records(events)[-1][0]
    time.sleep(watch_s)
    log = page.evaluate("() => window.plotLog")
    page.close()
    records = [(s, t) for s, t in train_records(events) if s > first_step + 1]
    latencies = []
    for s, t in records:  # one point per logged step (log_every_n_steps 1, fewer than MAX_POINTS)
        seen = [ts for ts, points in log if points >= s]
        if seen:
            latencies.append(seen[0] - t)
    return latencies


def row(name: str, values: list[float], target: float) -> str:
    if not values:
        return f"| {name} | 0 | – | – | – | < {target:g} s | no samples |"
    p90 = sorted(values)[int(0.9 * (len(values) - 1))]
    verdict = "met" if max(values) < target else ("median met" if statistics.median(values) < target else "missed")
    return (f"| {name} | {len(values)} | {statistics.median(values):.2f} s | {p90:.2f} s | "
            f"{max(values):.2f} s | < {target:g} s | {verdict} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", type=int, default=5, help="page loads to time")
    parser.add_argument("--watch", type=float, default=60.0, help="seconds of training to watch")
    parser.add_argument("--steps", type=int, default=390,
                        help="max_steps of the 2-rank run (< 400: every step keeps its own point in the plot)")
    args = parser.parse_args()
    from gradio_client import Client
    from playwright.sync_api import sync_playwright

    root = Path(tempfile.mkdtemp(prefix="bench-web-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    app = serve(root / "runs", port, root / "app.log")
    try:
        client = Client(url, verbose=False)
        config = {"train": {"max_steps": args.steps}, "eval": {"every_n_steps": 0, "at_end": False},
                  "parallel": {"nproc": 2}, "checkpoint": {"save_at_end": False},
                  "logging": {"run_name": "bench", "tensorboard": False}}
        client.predict(config=json.dumps(config), preset="embedded default", api_name="/start")
        events = root / "runs" / "bench" / "events.jsonl"
        deadline = time.monotonic() + 600
        while client.predict(run="bench", api_name="/status")["step"] < 3:
            if time.monotonic() > deadline:
                raise SystemExit("the run did not start training within 600 s")
            time.sleep(2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=ARGS)
            loads = page_loads(browser, url, args.loads)
            latencies = step_latencies(browser, url, events, args.watch)
            browser.close()
        status = client.predict(run="bench", api_name="/status")
        if status["alive"]:
            client.predict(run="bench", save=False, api_name="/stop")
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
    steps = train_records(events)
    rate = (steps[-1][0] - steps[0][0]) / max(1e-9, steps[-1][1] - steps[0][1]) if len(steps) > 1 else 0
    print(f"\n2-rank run of the embedded default: {rate:.2f} steps/s while measured; "
          f"{status['state']} at step {status['step']}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| measure | samples | median | p90 | max | target | |")
    print("|---|---|---|---|---|---|---|")
    print(row("page load to interactive", loads, 2.0))
    print(row("step logged to its point in the plot", latencies, 3.0))


if __name__ == "__main__":
    main()
