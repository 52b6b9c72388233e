"""The web app under test and what the browser tests share: the app served by its real entry point
(`python -m app`) on a free loopback port (the `app` fixture), Debian's Chromium through playwright
(`browser`), ending every run the app started, and the page helpers (the run's state and step,
tabs, number boxes, a chat question). Fixtures are module-scoped: a test file that imports them
gets one app and one browser for all its tests."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dist_utils import free_port
from supervisor.procs import group_alive

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SLOW = 240_000  # ms: this machine is shared, a run's start can take minutes under load


def end_runs(runs: Path) -> None:
    """Leave nothing behind: end the process group of every run the app started."""
    for pid_file in runs.glob("*/launcher.pid"):
        pgid = int(pid_file.read_text())
        if group_alive(pgid, pid_file.parent):  # still the run's (a pid outlives its group: reuse)
            os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def served_app(root: Path, env: dict[str, str] | None = None):
    """The app (`python -m app`) on a free port, runs under `root`/runs, its output in
    `root`/app.log; `env` added to its environment. Yields (url, runs folder, the app's pid); ends
    every run."""
    runs, port = root / "runs", free_port()
    full_env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", LIVETUNE_HEARTBEAT_S="0.5",
                    PYTHONPATH=str(REPO), **(env or {}))
    log = open(root / "app.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "app", "--port", str(port), "--output-dir", str(runs)],
                            cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            urllib.request.urlopen(url, timeout=5)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the app did not come up:\n" + (root / "app.log").read_text()[-3000:])
            time.sleep(1)
    try:
        yield url, runs, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        end_runs(runs)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The app on a free port; yields (url, runs folder)."""
    with served_app(tmp_path_factory.mktemp("web")) as (url, runs, _):
        yield url, runs


SCREENSHOTS_ENV = "LIVETUNE_SCREENSHOTS"  # set (to 1) to write the docs' pictures (docs/img/)


def screenshot(page, name: str, selector: str | None = None) -> Path | None:
    """With LIVETUNE_SCREENSHOTS set: the page (or the element `selector`) as docs/img/`name`.png,
    the pictures the docs show, taken by the tests' own browser so they stay current."""
    if not os.environ.get(SCREENSHOTS_ENV):
        return None
    out = REPO / "docs" / "img" / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    (page.locator(selector).first if selector else page).screenshot(path=str(out))
    return out


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (./launch.sh test installs it)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


# -- page helpers ---------------------------------------------------------------------------------

def loss_points(page) -> int:
    """Points of the longest line drawn in the Train tab's loss plot (the raw loss)."""
    return page.evaluate("""() => Math.max(0, ...Array.from(
        document.querySelectorAll('#train-plot-loss svg path')).map(
        p => ((p.getAttribute('d') || '').match(/[ML]/g) || []).length))""")


def state(page) -> str:
    return page.locator("#run-state").inner_text(timeout=SLOW)


def step(page) -> int:
    return int(re.search(r"step (\d+)", page.locator("#run-step").inner_text()).group(1))


def chat_header_step(page) -> int | None:
    """The step the Chat tab's header says the run is at ("Talking to run X -- running, step N")."""
    found = re.search(r"running, step (\d+)", page.locator("#chat-about").inner_text())
    return int(found.group(1)) if found else None


def wait_until(predicate, timeout_s: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def set_number(page, elem_id: str, value: str) -> None:
    box = page.locator(f"#{elem_id} input").first
    box.fill(value)
    box.press("Tab")


def open_tab(page, name: str) -> None:
    """A top-level tab (the first tab button of that name: section tabs come later in the page)."""
    page.get_by_role("tab", name=name, exact=True).first.click()


def open_section(page, name: str) -> None:
    page.locator("#cfg-sections").get_by_role("tab", name=name, exact=True).click()


def ask(page, text: str) -> str:
    """Send a chat message; return the answer once it is tagged with its step."""
    before = page.locator("#chat-live .bot").count()
    page.locator("#chat-input textarea").fill(text)
    page.locator("#chat-send").click()
    wait_until(lambda: page.locator("#chat-live .bot").count() > before, 60, "the answer bubble")
    answer = page.locator("#chat-live .bot").last
    wait_until(lambda: re.search(r"step \d+ · live weights|⚠", answer.inner_text()), SLOW / 1000,
               "an answer tagged with its step")
    return answer.inner_text()
