"""The web app served by its real entry point (`python -m app`) on a free loopback port, with real
runs of the embedded default behind it: driven by a real browser (Debian's Chromium through
playwright) and by `gradio_client` against the documented endpoints. The app, the browser and
the page helpers: tests/web_page.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from supervisor.procs import group_alive
from web_page import (SLOW, app, ask, browser, chat_header_step, loss_points, open_section,  # noqa: F401
                      open_tab, set_number, state, step, wait_until)  # (app, browser: the module's fixtures)

pytestmark = pytest.mark.slow  # a browser, a kernel or engine processes: the slow tier

# long enough to be stopped by the test, never to finish by itself; no evaluation in the way
RUN_STEPS = 100_000  # on any CPU, however fast


def schedule_factors(cfg: dict, n: int) -> list[float]:
    """The run's learning-rate schedule as factors of its base rate after 0, 1, ... n - 1
    updates: the engine's own scheduler (transformers.get_scheduler) built from its config."""
    import torch
    from transformers import get_scheduler
    optim, total = cfg["optim"], cfg["train"]["max_steps"]
    warmup = optim["warmup_steps"] or int(optim["warmup_ratio"] * total)
    names = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler(names[optim["scheduler"]], opt, num_warmup_steps=warmup, num_training_steps=total)
    factors = []
    for _ in range(n + 1):
        factors.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return factors


# -- the browser --------------------------------------------------------------------------------

def test_browser_configure_train_chat_pause_reload_stop(app, browser, tmp_path):
    url, runs = app
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    start = page.locator("#cfg-start")
    start.wait_for(timeout=SLOW)
    assert page.locator("#cfg-preset input").input_value() == "embedded default"
    assert start.is_enabled()

    # a bad value: its message under its field, Start disabled until it is fixed
    open_section(page, "Training")
    set_number(page, "cfg-train-micro-batch-size", "0")
    field = page.locator("#cfg-train-micro-batch-size")
    wait_until(lambda: "invalid" in (field.get_attribute("class") or ""), 60, "the field marked invalid")
    assert "must be at least 1, got 0" in field.inner_text()
    wait_until(start.is_disabled, 30, "Start to be disabled")
    assert "train.micro_batch_size" in page.locator("#cfg-summary").inner_text()
    set_number(page, "cfg-train-micro-batch-size", "16")
    wait_until(lambda: "invalid" not in (field.get_attribute("class") or ""), 60, "the field valid again")
    assert "must be at least" not in field.inner_text()
    set_number(page, "cfg-train-max-steps", str(RUN_STEPS))
    open_section(page, "Evaluation")
    set_number(page, "cfg-eval-every-n-steps", "0")
    wait_until(start.is_enabled, 30, "Start to be enabled again")
    # where each value comes from: the form's own changes, the rest from the preset
    origin = page.locator("#cfg-provenance")
    wait_until(lambda: "train.micro_batch_size=16" in origin.inner_text(), 30, "the form's values named")
    assert "from the preset 'embedded default'" in origin.inner_text()

    start.click()
    wait_until(lambda: state(page) == "running" and step(page) >= 2, SLOW / 1000, "the run to train")
    first = loss_points(page)
    wait_until(lambda: loss_points(page) >= first + 2, 120, "new points in the loss plot")
    assert not page.locator("#train-plot-rewards").is_visible()  # an SFT run logs no rewards: hidden
    run = next(p for p in runs.iterdir() if p.is_dir())  # the output folder also holds the API keys
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["train"]["max_steps"] == RUN_STEPS and cfg["train"]["micro_batch_size"] == 16

    # chat mid-training: the header follows the run while the Chat tab shows (the page's live
    # feed); answers are streamed, tagged with the step they came from
    open_tab(page, "Chat")
    shown = wait_until(lambda: chat_header_step(page), 60, "the Chat tab's header on the running run")
    wait_until(lambda: (chat_header_step(page) or 0) > shown, 120, "the Chat tab's header to follow the run")
    page.locator("#chat-settings").click()
    set_number(page, "chat-temperature", "1")
    page.evaluate("""() => { window.chatTexts = [];
        new MutationObserver(() => { const b = document.querySelectorAll('#chat-live .bot');
          if (b.length) window.chatTexts.push(b[b.length - 1].innerText); })
        .observe(document.querySelector('#chat-live'), {subtree: true, childList: true, characterData: true}); }""")
    answer = ask(page, "reverse: hello")
    assert "⚠" not in answer, answer
    trained_at = int(re.search(r"step (\d+) · live weights", answer).group(1))
    assert trained_at >= 2
    texts = page.evaluate("() => window.chatTexts")
    assert len(set(texts)) >= 2, texts  # the bubble changed as the answer came in

    # pause: the step stands still, the chat still answers (at the paused step), then resume
    open_tab(page, "Train")
    page.locator("#train-pause").click()
    wait_until(lambda: state(page) == "paused", 120, "the paused state")
    held, paused_at = step(page), time.monotonic()
    open_tab(page, "Chat")
    paused_answer = ask(page, "upper: abc")
    assert f"step {held} · live weights" in paused_answer
    # Teach on that answer: the pair goes into the run's inbox
    page.locator("#chat-teach-fold").click()
    wait_until(lambda: "upper: abc" in page.locator("#chat-teach-which input").input_value(), 30,
               "the last question offered to Teach")
    page.locator("#chat-teach-answer textarea").fill("ABC")
    page.locator("#chat-teach").click()
    wait_until(lambda: "Taught t1" in page.locator("#chat-teach-result").inner_text(), 120, "the teach answer")
    assert '"answer": "ABC"' in (run / "inbox.jsonl").read_text()
    # the branches section: the tree, and Snapshot now while paused
    open_tab(page, "Checkpoints")
    wait_until(lambda: "main" in page.locator("#branch-tree").inner_text(), 60, "the branch tree")
    assert "◀ training here" in page.locator("#branch-tree").inner_text()
    page.locator("#branch-snapshot").click()
    wait_until(lambda: f"kept at step {held}" in page.locator("#branch-result").inner_text(), 120, "the snapshot")
    # the step stood still through the chat, Teach and the snapshot (the engine kept it at `held`
    # above), and for 4 s at least: waited out only where those took less
    time.sleep(max(0.0, 4 - (time.monotonic() - paused_at)))
    open_tab(page, "Train")
    assert step(page) == held
    page.locator("#train-resume").click()
    wait_until(lambda: state(page) == "running" and step(page) > held, 120, "training to go on")

    # reload mid-run: the page opens on the run, its plots rebuilt from the event log
    seen = step(page)
    page.reload()
    wait_until(lambda: page.locator("#run-state").count() and state(page) == "running", 120,
               "the run's state after a reload")
    wait_until(lambda: loss_points(page) >= seen, 60, "the loss history after a reload")
    page.screenshot(path=str(tmp_path / "train.png"), full_page=True)
    if os.environ.get("LIVETUNE_SHOTS"):
        shutil.copy(tmp_path / "train.png", Path(os.environ["LIVETUNE_SHOTS"]) / "test-train.png")

    page.locator("#train-stop").click()
    wait_until(lambda: state(page) == "finished", 180, "the run to stop")
    pgid = int((run / "launcher.pid").read_text())
    wait_until(lambda: not group_alive(pgid, run), 30, "every process of the run to end")
    page.close()


# -- gradio_client against the documented endpoints ------------------------------------------------

def test_gradio_client_start_chat_set_stop(app):
    from gradio_client import Client
    url, runs = app
    client = Client(url, verbose=False)
    config = {"train": {"max_steps": RUN_STEPS, "micro_batch_size": 16}, "eval": {"every_n_steps": 0},
              "logging": {"run_name": "api-run"}}
    info = client.predict(config=json.dumps(config), preset="embedded default", api_name="/start")
    assert info["run"] == "api-run" and info["alive"]
    wait_until(lambda: client.predict(run="api-run", api_name="/status")["step"] >= 3, SLOW / 1000,
               "the run to train")

    for _ in range(5):  # a sample may end at once (end-of-text drawn first): then nothing streams
        job = client.submit(message="sort: dcba", run="api-run", max_new_tokens=24, temperature=1.0,
                            api_name="/chat")
        final = job.result(timeout=SLOW / 1000)
        partials = job.outputs()
        if final["text"]:
            break
    assert final["done"] and isinstance(final["step"], int) and final["step"] >= 2
    assert len(partials) >= 2 and not partials[0]["done"]  # streamed before it was done

    # the OpenAI-compatible API on the app's own port (app.web.openai_mount), the folder's key
    import openai
    from contract.run_folder import key_of
    api = openai.OpenAI(base_url=f"{url}/v1", api_key=key_of(runs), max_retries=0, timeout=SLOW / 1000)
    assert "api-run" in [m.id for m in api.models.list().data]
    answer = api.completions.create(model="api-run", prompt="sort: dcba\n", max_tokens=6, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens <= 6

    # above the schedule's peak (3e-3): never within 5% of the unchanged schedule's own next rate,
    # whichever step the change lands on (5e-4 once met the warm-up ramp there)
    changed = client.predict(run="api-run", lr=6e-3, api_name="/set")
    assert changed["changes"]["lr"] == pytest.approx(6e-3)
    status = client.predict(run="api-run", api_name="/status")
    set_at = changed["step"]
    assert status["state"] == "running"
    assert changed["applies_from_step"] == set_at + 1
    wait_until(lambda: client.predict(run="api-run", api_name="/status")["step"] > set_at + 2, 120,
               "two steps after the change")
    events = [json.loads(line) for line in (runs / "api-run" / "events.jsonl").read_text().splitlines()]
    lrs = {e["step"]: e["lr"] for e in events if e["type"] == "train"}
    # each train record logs the rate its step trained with: step k trains with the schedule's
    # factor after k - 1 updates (checked on the steps before the change); the step after the
    # change trains with 6e-3, and the schedule goes on from there scaled by the same factor
    read_at = status["step"]
    cfg = yaml.safe_load((runs / "api-run" / "config.yaml").read_text())
    factor = schedule_factors(cfg, max(max(lrs), read_at) + 2)
    base = cfg["optim"]["lr"]
    assert all(lrs[k] == pytest.approx(base * factor[k - 1], rel=1e-6) for k in range(1, set_at + 1) if k in lrs)
    for k in (set_at + 1, set_at + 2):
        assert lrs[k] == pytest.approx(6e-3 * factor[k - 1] / factor[set_at], rel=1e-6)
    # the status read just after the change shows the new value, moved on by the schedule for
    # any steps the run took in between (it does not stop to wait for the reader)
    assert status["settings"]["lr"] == pytest.approx(6e-3 * factor[read_at] / factor[set_at], rel=1e-6)

    # the branch and data endpoints: the contract's commands by name
    snap = client.predict(run="api-run", name="api", api_name="/snapshot")
    assert snap["name"] == "api" and snap["bytes"] > 0
    tree = client.predict(run="api-run", api_name="/branches")
    assert tree["current"] == "main" and "api" in tree["snapshots"]
    taught = client.predict(prompt="capital: zorb", answer="qux", run="api-run", api_name="/teach")
    assert taught["id"] == "t1"
    assert [e["answer"] for e in client.predict(run="api-run", api_name="/inbox")["entries"]] == ["qux"]
    with pytest.raises(Exception, match="no source named 'nope'"):
        client.predict(source="nope", weight=1.0, run="api-run", api_name="/set_weight")
    # a GRPO run's endpoints: this SFT run refuses them, saying why (after the command's own checks)
    with pytest.raises(Exception, match="only a GRPO run's samples can be rated"):
        client.predict(step=1, sample=0, score="up", run="api-run", api_name="/rate")
    with pytest.raises(Exception, match="'score' must be"):
        client.predict(step=1, sample=0, score="sideways", run="api-run", api_name="/rate")
    with pytest.raises(Exception, match="Reward: type an entry"):
        client.predict(reward="just words", run="api-run", api_name="/add_reward")
    with pytest.raises(Exception, match="remove_reward: needs a GRPO run"):
        client.predict(reward="exact_match", run="api-run", api_name="/remove_reward")

    # no `save` given: the contract's Stop default, as the Stop button and the notebook's stop()
    stopped = client.predict(run="api-run", api_name="/stop")
    assert stopped["state"] == "finished" and not stopped["alive"] and stopped["stopped_by_user"]
    assert not group_alive(stopped["pid"], runs / "api-run")
    assert any((p / "COMPLETE.json").exists() for p in (runs / "api-run" / "checkpoints").glob("step-*"))
    assert any((runs / "api-run" / "model").iterdir())  # saved first: a checkpoint and the model
    from gradio_client.exceptions import AppError
    with pytest.raises(AppError, match="takes no commands"):
        client.predict(run="api-run", api_name="/pause")
    with pytest.raises(AppError, match="no run 'nope'"):
        client.predict(run="nope", api_name="/status")


def test_browser_shows_a_failed_run_with_its_last_log_lines(app, browser, tmp_path):
    """A model folder that cannot load: the run fails at start-up; the page says so in a
    banner naming the run and showing the rank's last log lines (no stack trace in a dialog)."""
    from gradio_client import Client
    url, runs = app
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    # a tokenizer too: the pre-flight check passes (it does not load the model class), and the
    # run fails at start-up in the engine, on the unknown architecture
    from conftest import make_tiny_tokenizer
    make_tiny_tokenizer().save_pretrained(broken)
    config = {"model": {"path": str(broken)}, "train": {"max_steps": 5}, "logging": {"run_name": "broken"}}
    Client(url, verbose=False).predict(config=json.dumps(config), preset="", api_name="/start")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    open_tab(page, "Runs")
    page.locator("#runs-refresh").click()
    wait_until(lambda: "broken" in page.locator("#runs-table").inner_text(), 60, "the run in the list")
    choice = page.locator("#runs-choice input")
    choice.click()
    page.get_by_role("option", name=re.compile(r"^broken \(")).click()
    page.locator("#runs-open").click()
    open_tab(page, "Train")
    banner = page.locator("#fail-banner")
    banner.wait_for(state="visible", timeout=SLOW)
    text = banner.inner_text()
    assert "Run broken failed" in text and "no-such-architecture" in text, text
    assert state(page) == "failed"
    assert page.locator("#train-pause").is_disabled() and page.locator("#train-stop").is_disabled()
    page.close()


def test_an_idle_page_asks_for_about_a_frame_a_second_not_sixty(app, browser):
    """Gradio's status tracker would ask for an animation frame 60 times a second for as long as
    a page is open (app.web.early_script); the app's page script slows it to one a second. The
    counter below sits under everything the page installs, so it sees each frame asked for."""
    url, _ = app
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_init_script("""window.framesAsked = 0; const ask = window.requestAnimationFrame.bind(window);
        window.requestAnimationFrame = cb => { window.framesAsked += 1; return ask(cb); };""")
    page = context.new_page()
    page.goto(url)
    page.locator("#tab-configure").wait_for(state="attached", timeout=SLOW)
    open_tab(page, "Configure")  # no live plots there: only Gradio's own frames are counted
    # the page's start-up transitions ask for frames of their own, for a while: 3 s windows are
    # measured until one is quiet (unthrottled, every window asks for ~60 a second). A rate, timed
    # by the page's own clock: a busy machine that stretches a window asks for fewer frames per
    # second, never more
    rates = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (rates and rates[-1] <= 5):
        before = page.evaluate("() => [window.framesAsked, performance.now()]")
        time.sleep(3)
        after = page.evaluate("() => [window.framesAsked, performance.now()]")
        rates.append((after[0] - before[0]) / ((after[1] - before[1]) / 1000))
    context.close()
    assert rates[-1] <= 5, f"animation frames a second asked for by an idle page, 3 s windows: {rates} (60 unthrottled)"
