"""The notebooks as a user opens them: `./launch.sh notebook` serves JupyterLab (with the widgets
extension and the `livetune` kernel), Chromium opens the quickstart, runs all cells, and the run
panel is drawn as widgets (not as its fallback note) and follows the run's steps.

The notebooks are copied into a temporary folder that JupyterLab serves, so its autosave never
writes outputs into the repository's notebooks."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from supervisor.procs import group_alive

REPO = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
STEP = re.compile(r"step (\d+)/\d+")

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")


@pytest.fixture()
def lab(tmp_path):
    """JupyterLab from `./launch.sh notebook` on a free loopback port with a token; yields
    (url, token, runs folder); ends it and every run the notebook started."""
    if shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (./launch.sh test installs it)")
    shutil.copytree(REPO / "notebooks", tmp_path / "root" / "notebooks")
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, LIVETUNE_VENV=sys.prefix, LIVETUNE_OUTPUT_DIR=str(tmp_path / "runs"),
               LIVETUNE_CACHE=str(tmp_path / "cache"), JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"))
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [str(REPO / "launch.sh"), "notebook", "--no-browser", f"--port={port}", f"--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path / 'root'}"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail("JupyterLab exited:\n" + (tmp_path / "lab.log").read_text()[-3000:])
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
            return True
        except OSError:
            return False

    try:
        wait_for(up, 120, "JupyterLab to answer")
        yield url, token, tmp_path / "runs"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        for pid_file in (tmp_path / "runs").glob("*/launcher.pid"):  # the runs this notebook started
            with contextlib.suppress(ProcessLookupError, ValueError):
                if group_alive(int(pid_file.read_text()), pid_file.parent):  # still the run's
                    os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def test_quickstart_in_jupyterlab_draws_the_panel_and_follows_the_run(lab):
    from playwright.sync_api import sync_playwright

    url, token, runs = lab
    kernels = Path(sys.prefix) / "share" / "jupyter" / "kernels" / "livetune" / "kernel.json"
    assert kernels.exists() and sys.prefix in kernels.read_text()  # the notebooks' kernel: this venv
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/lab/tree/notebooks/quickstart.ipynb?token={token}")
            # the notebook names the livetune kernel, which JupyterLab starts without asking
            page.locator(".jp-Notebook").first.wait_for(timeout=120_000)
            wait_for(lambda: "livetune" in page.locator(".jp-Toolbar-kernelName").first.inner_text(),
                     120, "the livetune kernel")
            wait_for(lambda: page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count()
                     or "Idle" in page.locator(".jp-StatusBar-Widget").all_inner_texts().__str__(),
                     120, "the kernel to be idle")
            page.locator(".lm-MenuBar-item", has_text="Run").first.click()
            page.locator(".lm-Menu-item", has_text="Run All Cells").first.click()

            def panel_step() -> int | None:
                texts = page.locator(".jp-OutputArea .widget-html-content").all_inner_texts()
                steps = [int(m.group(1)) for t in texts for m in [STEP.search(t)] if m]
                return max(steps) if steps else None

            first = wait_for(lambda: (panel_step() or 0) >= 1 and panel_step(), 150, "the panel to show a step")
            assert page.locator(".jp-OutputArea .jupyter-widgets").count() > 0  # drawn as widgets
            assert page.get_by_text("Widgets cannot be shown here").count() == 0
            # the config's section tabs and the learning-rate box's label are shown whole, not cut
            # to "Optimizat" or "learning r..." (the labels' text is whole; the box clips it)
            labels = page.locator(".jp-OutputArea .widget-tab .lm-TabBar-tabLabel")
            wait_for(lambda: labels.count() >= 10, 60, "the config form's section tabs")
            cut = page.evaluate("""() => Array.from(document.querySelectorAll(
                '.jp-OutputArea .widget-tab .lm-TabBar-tabLabel, .jp-OutputArea .widget-label'))
                .filter(e => e.classList.contains('lm-TabBar-tabLabel') || /learning rate$/.test(e.innerText))
                .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.innerText)""")
            assert cut == [], f"cut off: {cut}"
            if os.environ.get("LIVETUNE_SHOTS"):
                shots = Path(os.environ["LIVETUNE_SHOTS"])
                page.locator(".jp-OutputArea .widget-tab").first.screenshot(path=str(shots / "test-notebook-form.png"))
                lr = page.locator(".jp-OutputArea .widget-label", has_text="learning rate").last.locator("xpath=../..")
                lr.screenshot(path=str(shots / "test-notebook-lr.png"))
            wait_for(lambda: (panel_step() or 0) > first, 120, "the panel to follow the run's steps")
        finally:
            browser.close()
    assert any(runs.iterdir()), "the notebook started a run in LIVETUNE_OUTPUT_DIR"
