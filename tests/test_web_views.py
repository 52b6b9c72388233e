"""The web app's run view without a browser: the view folded from a real event log (thinned for
long runs, several runs on one set of axes), the train tab's look keyed by component and run
state, the live feed and plot batches that send only what the page lacks, the early script."""

from __future__ import annotations

import json
import time

import pytest

from app.web.backend.views import MAX_POINTS, RunView
from contract.run_folder import EventLog, RunFolder

# -- the run view ---------------------------------------------------------------------------------

def _log(folder: RunFolder, events: list[dict]) -> None:
    log = EventLog(folder.events)
    for e in events:
        log.emit(dict(e))
    log.close()


def test_run_view_folds_the_event_log(tmp_path):
    folder = RunFolder(tmp_path / "run").create()
    t0 = time.time() - 11  # the last train record (step 5) was written just now
    _log(folder, [{"type": "state", "state": "starting", "method": "lora", "time": t0},
                  {"type": "setup", "total_steps": 10, "time": t0 + 1},
                  {"type": "state", "state": "running", "time": t0 + 1}]
         + [{"type": "train", "step": s, "epoch": 0, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 100.0,
             "mem_mb": 500.0, "time": t0 + 1 + 2 * s} for s in range(1, 6)]
         + [{"type": "eval", "step": 5, "eval/loss": 4.0, "eval/perplexity": 54.6, "eval/exact_match": 0.25,
             "time": t0 + 20}])
    view = RunView(folder)
    assert view.poll() == 1 and view.poll() == 1  # nothing new: same version
    frames = view.frames(smoothing=0.0)
    loss = frames["loss"]
    assert list(loss[loss.series == "raw"]["loss"]) == pytest.approx([4.9, 4.8, 4.7, 4.6, 4.5])
    assert list(loss[loss.series == "smoothed"]["loss"]) == pytest.approx([4.9, 4.8, 4.7, 4.6, 4.5])
    assert list(loss[loss.series == "eval"]["step"]) == [5]
    assert set(frames["eval"].series) == {"exact_match"}  # loss and perplexity go with the loss
    p = view.progress()
    assert (p.state, p.step, p.total, p.method) == ("running", 5, 10, "lora")
    assert p.eta_s == pytest.approx(10.0, abs=1.0)  # 5 steps left x 2 s per step
    assert view.metrics_at(5) == {"loss": pytest.approx(4.5), "eval/loss": 4.0, "eval/perplexity": 54.6,
                                  "eval/exact_match": 0.25}
    with open(folder.events, "a") as f:  # a line being written is left for the next poll
        f.write('{"type": "train", "step": 6, "loss": 1.0')
    assert view.poll() == 1
    with open(folder.events, "a") as f:
        f.write(', "time": 1}\n')
    assert view.poll() == 2 and view.history.summary.step == 6
    fresh = RunView(folder)  # a page opened later rebuilds the same history
    fresh.poll()
    assert fresh.history.train == view.history.train
    smoothed = fresh.frames(smoothing=0.9)["loss"]
    assert smoothed[smoothed.series == "smoothed"]["loss"].iloc[0] == pytest.approx(4.9)  # debiased


def test_run_view_thins_long_runs_keeping_the_newest_point(tmp_path):
    folder = RunFolder(tmp_path / "run").create()
    _log(folder, [{"type": "train", "step": s, "loss": 1.0, "time": float(s)} for s in range(1, 1001)])
    view = RunView(folder)
    view.poll()
    raw = view.frames()["loss"].query("series == 'raw'")
    assert len(raw) == MAX_POINTS and raw.step.iloc[-1] == 1000 and raw.step.iloc[0] == 1


# -- the Train tab's look at a run -------------------------------------------------------------------

def test_the_train_tabs_look_is_keyed_by_component_and_follows_the_run_state(tmp_path):
    import gradio as gr

    from app.web import train
    from app.web.backend import Backend

    folder = RunFolder(tmp_path / "runs" / "done").create()
    _log(folder, [{"type": "state", "state": "starting", "time": 1.0}, {"type": "setup", "total_steps": 3, "time": 1.0}]
         + [{"type": "train", "step": s, "loss": 3.0 - s, "lr": 0.1, "time": 1.0 + s} for s in (1, 2, 3)]
         + [{"type": "state", "state": "finished", "step": 3, "time": 5.0}])
    backend = Backend(tmp_path / "runs")
    try:
        with gr.Blocks():
            view = train.TrainView(gr.State(None), gr.State(None), gr.Checkbox(), gr.HTML(), gr.HTML(),
                                   gr.Code(), gr.Textbox(), {name: gr.Button() for name in train.COMMAND_OF},
                                   gr.Button(), None, gr.HTML())
        out = train.refresh(backend, view, None, None)  # the page's first look: the newest run
        assert set(out) <= set(view.outputs()) and out[view.run_state] == str(folder.root)
        assert "finished" in out[view.status] and out[view.open_train] is False  # ended: stay put
        assert f"data-run='{folder.root}'" in out[view.marker] and "data-state='finished'" in out[view.marker]
        assert [b["interactive"] for b in (out[button] for button in view.buttons.values())] == \
            [False] * len(view.buttons)  # allowed_commands("finished") is empty
        assert view.lr not in out  # the learning-rate box is never filled in for the user
        # nothing changed: a second look sends neither the status, the buttons nor the marker again
        again = train.refresh(backend, view, str(folder.root), out[view.seen], log_open=True)
        assert view.status not in again and view.marker not in again
        assert not set(view.buttons.values()) & set(again)
        assert view.log in again  # opened: the log tail is sent once
        # a hidden tab is sent nothing but the run it shows (the feed reads it from the marker)
        hidden = train.refresh(backend, view, str(folder.root), again[view.seen], visible=False)
        assert set(hidden) == {view.run_state, view.seen}
        assert set(view.controls("paused")) == {*view.buttons.values(), view.start}
        enabled = {name for name, b in view.buttons.items() if view.controls("paused")[b]["interactive"]}
        assert enabled == {"resume", "stop", "stop_other", "save", "evaluate", "set_lr", "set_settings"}
        assert view.controls("paused")[view.buttons["resume"]]["variant"] == "primary"
        assert view.controls("running")[view.start]["variant"] == "secondary"  # a live run: Start is not primary
        assert view.controls("finished")[view.start]["variant"] == "primary"
        enabled = {name for name, b in view.buttons.items() if view.controls("stopping")[b]["interactive"]}
        assert enabled == {"stop", "stop_other"}  # a second stop ends the group at once
    finally:
        backend.close()


def test_the_live_feed_sends_only_what_the_page_lacks(tmp_path):
    from app.web.backend import Backend
    from app.web.feed import digest, feed

    folder = RunFolder(tmp_path / "runs" / "live").create()
    events = [{"type": "state", "state": "starting", "time": 1.0}, {"type": "setup", "total_steps": 9, "time": 1.0}]
    events += [{"type": "train", "step": s, "loss": 3.0 - s, "lr": 0.1, "time": 1.0 + s} for s in (1, 2, 3)]
    _log(folder, events)
    backend = Backend(tmp_path / "runs")
    run = str(folder.root)
    try:
        first = feed(backend, {"run": run})  # a page that holds nothing yet
        assert first["run"] == run and "step 3 / 9" in first["status"] and first["status_id"] == digest(first["status"])
        assert first["header"].startswith("Talking to run <strong>live</strong>") and "step 3 / 9" in first["header"]
        loss = json.loads(first["plots"]["train-plot-loss"])
        assert loss["path"] == run and loss["series"]["raw"] == {"reset": True, "points": [[1, 2.0], [2, 1.0], [3, 0.0]]}
        # the page now holds all of it: the next answer carries no status, header or points
        have = {i: {"path": run, "last": {k: v["points"][-1] for k, v in json.loads(b)["series"].items()}}
                for i, b in first["plots"].items()}
        known = {"status": first["status_id"], "header": first["header_id"], "version": first["version"]}
        same = feed(backend, {"run": run, "have": have, "known": known})
        assert "status" not in same and "header" not in same and same["plots"] == {}
        # two more steps: the status, the header and only the two new points of each line
        _log(folder, [{"type": "train", "step": s, "loss": 3.0 - s, "lr": 0.1, "time": 1.0 + s} for s in (4, 5)])
        later = feed(backend, {"run": run, "have": have, "known": known})
        assert "step 5 / 9" in later["status"] and "step 5 / 9" in later["header"]
        assert json.loads(later["plots"]["train-plot-loss"])["series"]["raw"] == {
            "reset": False, "points": [[4, -1.0], [5, -2.0]]}
        # the Chat tab on screen wants the header only: no status line, no points
        chat_only = feed(backend, {"run": run, "want": ["header"], "known": {"version": known["version"]}})
        assert "step 5 / 9" in chat_only["header"] and "status" not in chat_only and chat_only["plots"] == {}
        # what a page sends cannot break it: an unknown run or a malformed ask gets a reason back
        assert "error" in feed(backend, {"run": str(tmp_path / "nowhere")})
        assert feed(backend, "not a dict")["error"] == "no run"
        assert "error" not in feed(backend, {"run": run, "have": [1], "known": None})
    finally:
        backend.close()


def test_the_early_script_goes_first_in_the_pages_head_and_nowhere_else():
    import asyncio

    from app.web.early_script import EarlyScript

    def served(path: str, kind: bytes, body: bytes, chunks: int = 2) -> tuple[dict, bytes]:
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", kind), (b"content-length", str(len(body)).encode())]})
            step = len(body) // chunks + 1
            for i in range(0, len(body), step):
                await send({"type": "http.response.body", "body": body[i:i + step],
                            "more_body": i + step < len(body)})
        sent: list[dict] = []

        async def send(message):
            sent.append(message)
        asyncio.run(EarlyScript(app, b"<script>x</script>")({"type": "http", "method": "GET", "path": path},
                                                              None, send))
        headers = dict(sent[0]["headers"])
        return headers, b"".join(m.get("body", b"") for m in sent[1:])

    page = b"<html><head><title>t</title></head><body>hi</body></html>"
    headers, body = served("/", b"text/html; charset=utf-8", page)
    assert body == page.replace(b"<head>", b"<head><script>x</script>")
    assert int(headers[b"content-length"]) == len(body)
    assert served("/", b"application/json", b'{"<head>": 1}')[1] == b'{"<head>": 1}'
    assert served("/config", b"text/html", page)[1] == page  # only the page itself



def test_plot_batches_carry_only_what_the_page_lacks():
    from app.web.plots import batch, thin

    points = [(s, 10.0 - s) for s in range(1, 6)]
    first = json.loads(batch({"raw": points}, None, "/r", 1))
    assert first["series"]["raw"] == {"reset": True, "points": [[s, v] for s, v in points]}
    have = {"path": "/r", "last": {"raw": [3, 7.0]}}
    assert json.loads(batch({"raw": points}, have, "/r", 2))["series"]["raw"] == {
        "reset": False, "points": [[4, 6.0], [5, 5.0]]}  # appended points only
    assert batch({"raw": points}, {"path": "/r", "last": {"raw": [5, 5.0]}}, "/r", 3) is None
    # a resumed run trained step 3 again with another loss: the page gets the whole series anew
    rewound = points[:2] + [(3, 1.5)]
    assert json.loads(batch({"raw": rewound}, have, "/r", 4))["series"]["raw"]["reset"] is True
    # another run: everything anew, and a series the run lacks is emptied
    other = json.loads(batch({}, {"path": "/old", "last": {"raw": [1, 1.0]}}, "/r", 5))
    assert other["path"] == "/r" and other["series"] == {}
    gone = json.loads(batch({}, {"path": "/r", "last": {"eval": [1, 1.0]}}, "/r", 6))
    assert gone["series"] == {"eval": {"reset": True, "points": []}}
    long = [(s, float(s)) for s in range(1, 1001)]
    assert len(thin(long)) == MAX_POINTS and thin(long)[-1] == (1000, 1000.0) and thin(long)[0] == (1, 1.0)


def test_compare_series_puts_several_runs_on_one_set_of_axes(tmp_path):
    from app.web.backend.views import compare_series

    views = {}
    for name, shift in (("a", 0.0), ("b", 1.0)):
        folder = RunFolder(tmp_path / name).create()
        _log(folder, [{"type": "train", "step": s, "loss": 3.0 - s + shift, "time": float(s)} for s in (1, 2)]
             + [{"type": "eval", "step": 2, "eval/loss": 1.5 + shift, "eval/exact_match": 0.25, "time": 3.0}])
        views[name] = RunView(folder)
    series = compare_series(views)
    assert series["compare_loss"] == {"loss · a": [(1, 2.0), (2, 1.0)], "eval loss · a": [(2, 1.5)],
                                      "loss · b": [(1, 3.0), (2, 2.0)], "eval loss · b": [(2, 2.5)]}
    assert series["compare_eval"] == {"exact_match · a": [(2, 0.25)], "exact_match · b": [(2, 0.25)]}
