"""What a new user sees of the web app's layout, measured in a real browser (Debian's Chromium)
at 1440 px wide against the app's real entry point: the Runs, Checkpoints and inbox tables keep
every header on one line and their long paths, margins and last columns inside the table; the Runs tab shows its preselected run
(plot and config) without Open; a chat's label floats over no message. No engine is started: the
run folders are written as a finished run leaves them (its event log, config and checkpoints).

The app, the browser and the page helpers are tests/test_web.py's."""

from __future__ import annotations

import time

import pytest

from contract.config.load import config_from_dict
from contract.events import EventType
from contract.inbox import add_entry, inbox_path
from contract.presets import DEFAULT
from contract.protocol.states import RunState
from contract.run_folder import EventLog, RunFolder
import pytest
from web_page import SLOW, app, browser, open_section, open_tab, screenshot, wait_until  # noqa: F401  (app, browser: fixtures)

pytestmark = pytest.mark.slow  # a browser, a kernel or engine processes: the slow tier

NAME = "embedded-default-with-a-rather-long-run-name-20261204-203011"
STEPS = 30

# each header of the table on one line; the table inside its block; every cell's text inside its
# cell (a path wraps instead of running off the edge)
TABLE_JS = """(id) => {
    const block = document.getElementById(id), table = block.querySelector('table');
    const lines = el => { const r = document.createRange(); r.selectNodeContents(el);
                          return new Set(Array.from(r.getClientRects()).map(c => Math.round(c.top))).size; };
    const broken = Array.from(table.querySelectorAll('th .header')).filter(h => lines(h) > 1).map(h => h.innerText);
    const cut = Array.from(table.querySelectorAll('td .cell-wrap')).filter(c => c.scrollWidth > c.clientWidth + 1)
                     .map(c => c.innerText);
    return {broken, cut, table: table.getBoundingClientRect().right, block: block.getBoundingClientRect().right};
}"""


def finished_run(runs) -> RunFolder:
    """A finished run of the embedded default with a long name, two checkpoints (one incomplete)
    and a final model, as the engine leaves them."""
    folder = RunFolder(runs / NAME).create()
    folder.config.write_text(config_from_dict({**DEFAULT, "train": {"max_steps": STEPS}}).to_yaml())
    now = time.time()
    log = EventLog(folder.events)
    log.emit({"type": EventType.STATE.value, "state": RunState.STARTING.value, "time": now - 60})
    log.emit({"type": EventType.SETUP.value, "total_steps": STEPS, "time": now - 55})
    for s in range(1, STEPS + 1):
        log.emit({"type": EventType.TRAIN.value, "step": s, "loss": 4.0 - s / 20, "lr": 1e-3, "time": now - 50 + s})
    # two taught pairs (the A/B fold's), one checked: the inbox table's columns, margins and learned
    for n, (chosen, rejected) in enumerate((("wdock", "kcodw"), ("ABCDEFGH", "Abcdefgh")), 1):
        log.emit({"type": "teach", "step": 10, "id": f"t{n}", "answer": chosen, "rejected": rejected,
                  "margin": -0.123456, "time": now - 40})
        add_entry(inbox_path(folder.root), f"t{n}", f"<s>reverse: {rejected.lower()}\n", chosen, 10, rejected=rejected)
    log.emit({"type": "teach_check", "step": 20, "id": "t1", "old": "", "new": "wdoc", "learned": False,
              "margin_before": -0.123456, "margin_after": 0.654321, "prefers": "chosen", "time": now - 30})
    log.emit({"type": EventType.STATE.value, "state": RunState.FINISHED.value, "time": now})
    log.close()
    for name, complete in (("step-30", True), ("step-20", False)):
        (folder.checkpoints / name).mkdir(parents=True)
        (folder.checkpoints / name / "weights.bin").write_bytes(b"0" * 1024)
        if complete:
            (folder.checkpoints / name / "COMPLETE.json").write_text("{}")
    folder.model.mkdir(exist_ok=True)
    (folder.model / "config.json").write_text("{}")
    return folder


def table_fits(page, elem_id: str) -> None:
    """The table fits (TABLE_JS), once the page has sized its columns (a few seconds at most)."""
    found: dict = {}

    def fits() -> bool:
        found.update(page.evaluate(TABLE_JS, elem_id))
        return not found["broken"] and not found["cut"] and found["table"] <= found["block"] + 1
    try:
        wait_until(fits, 20, f"{elem_id} to fit")
    except pytest.fail.Exception:
        pytest.fail(f"{elem_id}: headers over two lines {found['broken']}, cells cut off {found['cut']}, "
                    f"table's right edge {found['table']} px, its block's {found['block']} px")


def test_tables_fit_the_runs_tab_shows_its_run_and_no_label_hides_a_message(app, browser):
    url, runs = app
    folder = finished_run(runs)
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.goto(url)
    page.locator("#tab-configure").wait_for(state="attached", timeout=SLOW)

    # Runs: the preselected run is shown at once (its plot and config), without Open
    open_tab(page, "Runs")
    wait_until(lambda: NAME in page.locator("#runs-table").inner_text(), 60, "the run in the table")
    assert page.locator("#runs-choice input").input_value().startswith(NAME)
    wait_until(lambda: page.locator("#runs-plot-loss svg path").count(), 60, "the preselected run's loss plot")
    # (the code box draws only the lines in view: the config's first section)
    wait_until(lambda: "model:" in page.locator("#runs-config").inner_text(), 60, "the preselected run's config")
    table_fits(page, "runs-table")

    page.locator("#runs-open").click()
    open_tab(page, "Checkpoints")
    wait_until(lambda: str(folder.checkpoints / "step-30") in page.locator("#ckpt-table").inner_text(), 60,
               "the checkpoints of the run")
    table_fits(page, "ckpt-table")

    # Train: the inbox's headers on one line each, its margins and removed column in view (no scrolling)
    open_tab(page, "Train")
    page.locator("#data-fold").click()
    wait_until(lambda: "kcodw" in page.locator("#data-inbox").inner_text(), 60, "the run's inbox")
    assert "answer (chosen)" in page.locator("#data-inbox").inner_text()
    table_fits(page, "data-inbox")

    # Chat: the label sits above the messages' window, not over the messages
    open_tab(page, "Chat")
    page.locator("#chat-live label").first.wait_for(timeout=60_000)
    # once the tab's header is in (it moves the chat down), both measured at the same moment
    wait_until(lambda: f"Talking to run {NAME}" in page.locator("#chat-about").inner_text(), 60, "the header")
    label, window = page.evaluate("""() => { const w = document.querySelector('#chat-live .bubble-wrap');
        const l = document.querySelector('#chat-live label');
        return [l.getBoundingClientRect().bottom, w.getBoundingClientRect().top + w.clientTop]; }""")
    assert label <= window + 1, f"the label's bottom at {label} px, the messages' window from {window} px"
    page.close()


def test_own_training_data_shows_a_page_of_rows_and_switches_evaluation_off_instead_of_turning_start_off(
        app, browser, tmp_path):
    import json
    url, _ = app
    data = tmp_path / "own.jsonl"
    data.write_text("".join(json.dumps({"input": f"reverse: w{n:03d}\n", "output": f"{n:03d}w"}) + "\n"
                            for n in range(80)))
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    try:
        page.goto(url)
        start = page.locator("#cfg-start")
        start.wait_for(timeout=SLOW)
        open_section(page, "Evaluation")
        every = page.locator("#cfg-eval-every-n-steps input").first
        assert every.input_value() == "100"  # the preset evaluates on the embedded task's split
        open_section(page, "Data")
        note = page.locator("#inspect-data-train")
        assert "embedded synthetic task" in note.inner_text()
        # opened, the section shows the embedded task's rows (the preset's objective: its instruction rows)
        wait_until(lambda: "rows 1-20 of 50000" in note.inner_text(), 120, "a page of the embedded task's rows")
        assert "reverse: " in note.inner_text() or "sort: " in note.inner_text()
        # DPO: the note follows the objective to the pairs variant and shows its pairs
        open_section(page, "Objective (SFT or preferences)")
        page.locator("#cfg-preference-objective input").click()
        page.get_by_role("option", name="dpo", exact=True).click()
        open_section(page, "Data")
        wait_until(lambda: "pairs variant" in note.inner_text() and "rejected" in note.inner_text(), 120,
                   "a page of the embedded task's pairs")
        assert "rows 1-20 of 50000" in note.inner_text()
        screenshot(page, "data-preview", "#inspect-data-train")  # the docs' picture (LIVETUNE_SCREENSHOTS=1)
        page.locator("#cfg-data-train textarea, #cfg-data-train input").first.fill(str(data))
        wait_until(lambda: "rows 1-20 of 80" in note.inner_text(), 120, "a page of the file's rows")
        # SFT rows under DPO: the page says a run refuses the file, at start and live
        assert "refused as a whole, at start and by a live add_source" in note.inner_text()
        open_section(page, "Objective (SFT or preferences)")
        page.locator("#cfg-preference-objective input").click()
        page.get_by_role("option", name="sft", exact=True).click()
        open_section(page, "Data")
        wait_until(lambda: "kept" in note.inner_text() and "refused" not in note.inner_text(), 120, "rows kept by SFT")
        assert "the run" in note.inner_text() and "rows 1-20 of 80" in note.inner_text()
        wait_until(lambda: "Evaluation switched off" in page.locator("#inspect-data-eval").inner_text(), 60,
                   "the note that evaluation is off")
        wait_until(start.is_enabled, 60, "Start enabled with the user's data")
        open_section(page, "Evaluation")
        assert every.input_value() == "0"
    finally:
        page.close()
