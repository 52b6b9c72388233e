"""The objective's own plot in the web app: a preference or GRPO run's rewards come first, above
the loss (make_plots), with smoothing like the loss, its evaluation values in its own panels rather
than repeated among the evaluation metrics; and no plot's x-axis end label is cut off. The page part
is measured in Debian's Chromium on the plots alone (no engine, no whole app)."""

from __future__ import annotations

import json
import time

import gradio as gr
import pytest

from app.web.backend.views import RunView
from app.web.plots import batch, make_plots
from contract.run_folder import EventLog, RunFolder
from dist_utils import free_port
from web_page import browser, wait_until  # noqa: F401 - browser: the fixture

STEPS = 1000  # a four-digit last step: its centred label would run past the picture


def _preference_run(tmp_path, grpo: bool = False) -> RunView:
    folder = RunFolder(tmp_path / "run").create()
    log = EventLog(folder.events)
    t0 = time.time() - STEPS
    for s in range(1, STEPS + 1, 10):
        metrics = {"reward": 0.1 + s / STEPS} if grpo else {
            "rewards/chosen": 0.01 * s, "rewards/rejected": -0.01 * s, "rewards/accuracies": (s % 3) / 2,
            "rewards/margins": 0.02 * s, "logps/chosen": -5.0, "logps/rejected": -6.0}
        log.emit({"type": "train", "step": s, "loss": 0.7 - s / 5000, "time": t0 + s, **metrics})
    if not grpo:
        log.emit({"type": "eval", "step": STEPS, "eval/loss": 0.6, "eval/rewards/chosen": 1.0,
                  "eval/rewards/rejected": -1.0, "eval/rewards/accuracies": 0.75, "eval/rewards/margins": 2.0,
                  "eval/exact_match": 0.0, "time": t0 + STEPS})
    log.close()
    view = RunView(folder)
    view.poll()
    return view


def test_the_objectives_plot_comes_first_and_is_smoothed():
    with gr.Blocks():
        plots = make_plots("t")
    assert list(plots.by_name)[:3] == ["rewards", "loss", "eval"]
    spec = json.loads(plots.by_name["rewards"].html_template.split("data-spec='")[1].split("'")[0]
                      .replace("&quot;", '"'))
    assert spec["smoothable"] and spec["grouped"]
    assert "lt-smooth" in plots.by_name["rewards"].html_template


def test_the_rewards_are_drawn_once_evaluation_included_and_a_grpo_runs_mean_reward_too(tmp_path):
    series = _preference_run(tmp_path).series()
    assert set(series["eval"]) == {"exact_match"}  # the rewards are not repeated among the eval metrics
    rewards = series["rewards"]
    assert {"reward accuracy · eval", "reward margin · eval", "rewards · eval chosen",
            "rewards · eval rejected", "rewards · chosen"} <= set(rewards)
    grpo = _preference_run(tmp_path / "grpo", grpo=True).series()["rewards"]
    assert list(grpo) == ["mean reward (GRPO) · train"] and grpo["mean reward (GRPO) · train"][-1][0] == 991


@pytest.mark.slow
def test_in_the_page_the_rewards_sit_above_the_loss_smoothed_and_no_axis_label_is_cut(tmp_path, browser):
    view = _preference_run(tmp_path)
    with gr.Blocks() as demo:
        plots = make_plots("t", full=False)
    for name, component in plots.by_name.items():
        component.value = batch(view.series()[name], None, "run", 1)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    page = browser.new_page(viewport={"width": 1300, "height": 1400})
    try:
        page.goto(f"http://127.0.0.1:{port}")
        page.locator("#t-plot-rewards svg").wait_for(timeout=60_000)
        page.locator("#t-plot-loss svg").wait_for(timeout=60_000)
        top = {n: page.locator(f"#t-plot-{n}").bounding_box()["y"] for n in ("rewards", "loss")}
        assert top["rewards"] < top["loss"], top
        # smoothed: each train line drawn twice (faded raw under its smoothing), eval points dotted
        faded = page.locator("#t-plot-rewards svg path[opacity='0.3']").count()
        assert faded >= 6, faded
        assert page.locator("#t-plot-rewards svg circle").count() >= 2
        page.locator("#t-plot-rewards .lt-smooth input").fill("0")
        wait_until(lambda: page.locator("#t-plot-rewards svg path[opacity='0.3']").count() == 0, 10,
                   "smoothing off: the raw lines alone")
        cut = page.evaluate("""() => Array.from(document.querySelectorAll('.lt-plot svg')).flatMap(svg => {
            const box = svg.getBoundingClientRect();
            return Array.from(svg.querySelectorAll('text.lt-tick')).map(t => [t.textContent, t.getBoundingClientRect()])
                .filter(([, r]) => r.right > box.right + 0.5 || r.left < box.left - 0.5).map(([s]) => s); })""")
        assert cut == [], cut
        assert page.locator("#t-plot-loss text.lt-tick", has_text=str(STEPS)).count() == 1
    finally:
        page.close()
        demo.close()
