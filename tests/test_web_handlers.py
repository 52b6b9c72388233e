"""The web app's round-3 handlers without a browser (each returns {component: value} or raises a
readable error): "Submit to Slurm" beside Start (the job script is written from the fold's
options through Session.submit, the terminal's code path, and Slurm's refusal is shown), the
queued state on the Train tab, the Configure tab's pre-flight warnings and where each value comes
from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gradio as gr
import pytest

from app.form import DEFAULT_PRESET
from app.session import SessionError
from app.web import configure, slurm, train
from app.web.backend import Backend
from app.web.backend.views import Progress
from app.web.backend.watch import Snapshot
from app.web.widgets import status_html
from contract.protocol.states import RunState
from contract.run_folder import RunFolder
from supervisor import RunInfo


@pytest.fixture
def backend(tmp_path):
    found = Backend(tmp_path / "runs")
    yield found
    found.close()


def _form_values(backend: Backend, **changes) -> dict:
    values = backend.form.preset_values(DEFAULT_PRESET)
    values.update(changes)
    return values


# -- Submit to Slurm ----------------------------------------------------------------------------

def test_the_slurm_fold_reads_its_options_and_names_each_bad_one():
    opts = slurm.options({"nodes": 2.0, "procs_per_node": 4, "gpus_per_node": 0, "cpus_per_task": 8,
                          "partition": " gpu ", "time": "2:00:00", "account": ""})
    assert (opts.nodes, opts.procs_per_node, opts.cpus_per_task, opts.partition, opts.time) == (2, 4, 8, "gpu", "2:00:00")
    with pytest.raises(gr.Error) as e:
        slurm.options({"nodes": 0, "procs_per_node": 1.5, "gpus_per_node": None, "cpus_per_task": 0,
                       "partition": "a b", "time": "", "account": ""})
    message = str(e.value.message)
    assert "procs_per_node: a whole number" in message and "gpus_per_node: a whole number" in message
    assert "partition: no spaces" in message
    with pytest.raises(gr.Error, match="nodes must be >= 1"):
        slurm.options({"nodes": 0, "procs_per_node": 0, "gpus_per_node": 0, "cpus_per_task": 0,
                       "partition": "", "time": "", "account": ""})


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="Slurm's sbatch is not installed")
def test_submit_to_slurm_writes_the_job_of_the_form_and_shows_slurms_refusal(backend, tmp_path, monkeypatch):
    # a Slurm client with a configuration that names no cluster: sbatch refuses at once, with its
    # own words (the real cluster's path is tests/test_slurm.py's, through the same Session.submit)
    conf = tmp_path / "slurm.conf"
    conf.write_text("")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    values = _form_values(backend, **{"logging.run_name": "web-slurm", "train.max_steps": 5})
    fold = {"nodes": 1, "procs_per_node": 2, "gpus_per_node": 0, "cpus_per_task": 2,
            "partition": "debug", "time": "0:10:00", "account": "lab"}
    with gr.Blocks():
        run_state, tabs = gr.State(None), gr.Tabs()
    with pytest.raises(SessionError, match="(?s)sbatch refused the job: .*ClusterName") as e:
        slurm.submit_run(backend, values, fold, run_state, tabs)
    assert not e.value.problems  # not a pre-flight refusal
    folder = RunFolder(tmp_path / "runs" / "web-slurm")
    script = (folder.root / "job.sbatch").read_text().splitlines()
    for line in ("#SBATCH --nodes=1", "#SBATCH --partition=debug", "#SBATCH --time=0:10:00",
                 "#SBATCH --account=lab", "#SBATCH --cpus-per-task=2"):
        assert line in script
    assert "--nproc_per_node=2" in script[-1]  # procs per node is the run's nproc
    events = [json.loads(line) for line in folder.events.read_text().splitlines()]
    assert events[-1]["state"] == "failed" and "sbatch refused" in events[-1]["error"]
    (listed,) = backend.session.runs()
    assert listed.name == "web-slurm" and listed.state == "failed" and not listed.alive
    # a config the pre-flight check refuses is not submitted at all
    bad = _form_values(backend, **{"data.train": str(tmp_path / "missing.jsonl"), "logging.run_name": "bad"})
    with pytest.raises(gr.Error, match="data.train"):
        slurm.submit_run(backend, bad, fold, run_state, tabs)
    assert not (tmp_path / "runs" / "bad").exists()


def test_a_queued_run_is_live_on_the_train_tab_and_only_stop_is_offered(tmp_path):
    folder = RunFolder(tmp_path / "runs" / "queued").create()
    (folder.root / "slurm_job.json").write_text(json.dumps({"job_id": "4242"}))
    info = RunInfo("queued", str(folder.root), "queued", True, 0, None, {}, 1.0, None, None, None, None)
    snap = Snapshot(str(folder.root), info, Progress("queued", 0, None, 0, None, 3.0, {}, {}, None), 1, None)
    text = status_html(snap)
    assert ">queued</span>" in text and "waiting in Slurm's queue (job 4242)" in text
    assert "run-branch" not in text  # a run that never branched does not say so
    from contract.branches import BranchTree
    tree = BranchTree()
    tree.add("slow", "main", 0, "")
    tree.current = "slow"
    tree.save(folder.root)
    assert "<span id='run-branch'>branch slow</span>" in status_html(snap)
    assert RunState.QUEUED.value in train.LIVE_STATES and "'queued'" in train.CONFIRM_START_JS
    with gr.Blocks():
        view = train.TrainView(gr.State(None), gr.State(None), gr.Checkbox(), gr.HTML(), gr.HTML(),
                               gr.Code(), gr.Textbox(), {name: gr.Button() for name in train.COMMAND_OF},
                               gr.Button())
    controls = view.controls("queued")
    assert {n for n, b in view.buttons.items() if controls[b]["interactive"]} == {"stop", "stop_other"}
    assert controls[view.start]["variant"] == "secondary"  # a live run: Start is not the primary button


# -- Configure: warnings and where each value comes from -----------------------------------------

def _rows_file(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_summary_shows_the_preflight_warnings_and_where_each_value_comes_from(backend, tmp_path):
    form = backend.form
    rows = [{"input": f"reverse: {w}", "output": w[::-1]} for w in ("abc", "hello", "zorb", "qux")]
    rows += [{"question": "no such keys"}] + [{"input": "x" * 1500, "output": "y" * 1500}] * 3
    rows += [{"input": f"reverse: {w}", "output": w[::-1]} for w in ("ab", "cd", "ef", "gh")]  # 11 usable rows:
    data = _rows_file(tmp_path / "train.jsonl", rows)  # at least one global batch of the fitted size (8)
    values = _form_values(backend, **{"data.train": data, "data.format": "input_output"})
    # the embedded default's preset with the user's own data: its evaluation schedule is refused
    #; the page says where each value comes from and offers the terminal's fit
    assert "eval.every_n_steps" in dict(form.check(values).problems)
    origin, fits = configure.provenance(form, values, DEFAULT_PRESET)
    assert "set on this form</b>: data.train=" in origin and "data.format=input_output" in origin
    assert "from the preset 'embedded default'</b>: " in origin and "data.max_length=32" in origin
    assert fits and "Your own model or data" in origin
    with gr.Blocks():
        tab = configure.ConfigureTab({f["key"]: gr.Textbox() for f in form.fields})
    fitted = configure.fit_own(form, tab, values, DEFAULT_PRESET)
    shown = {key: fitted[c] for key, c in tab.fields.items() if c in fitted}
    assert shown["train.max_steps"] == form.values_for()["train.max_steps"]  # the schema's default
    assert "data.train" not in shown and "data.format" not in shown  # what the user set stays
    after = {**values, **shown}
    assert configure.provenance(form, after, DEFAULT_PRESET)[1] is False  # nothing more to fit
    checked = form.check(after)
    assert checked.ok, checked.problems
    summary = configure._summary(form, checked)
    assert "The config is valid" in summary and "id='config-warnings'" in summary
    assert "Data › data.train" in summary and "row 5" in summary  # the dropped row, by number
    assert "<b>WARNING Data › data.max_length" in summary and "truncated" in summary  # loud: 3 of 7 rows cut
    # the embedded default itself: everything from the preset, no fitting offered
    plain = _form_values(backend)
    origin, fits = configure.provenance(form, plain, DEFAULT_PRESET)
    assert not fits and "set on this form" not in origin
    problems = _form_values(backend, **{"data.train": str(tmp_path / "nope.jsonl")})
    bad = form.check(problems)
    assert not bad.ok and "problem" in configure._summary(form, bad) and "config-warnings" not in configure._summary(form, bad)


# -- branches: the tree, the targets and the overlaid series, from the run folder ----------------

def test_the_branch_view_overlays_branches_and_keeps_abandoned_steps_apart(tmp_path):
    from app.branches import branch_view, tree_lines
    from contract.branches import BranchTree, checkpoints_dir

    folder = RunFolder(tmp_path / "run").create()
    train_ = lambda step, loss, branch=None: {"type": "train", "step": step, "loss": loss, "lr": 0.1,
                                              **({"branch": branch} if branch else {})}
    events = [{"type": "state", "state": "starting"}]
    events += [train_(s, 10.0 - s) for s in range(1, 7)]                        # main 1-6
    events += [{"type": "rewind", "step": 4, "from_step": 6, "abandoned": [5, 6], "source": "x"}]
    events += [train_(s, 20.0 - s) for s in (5, 6, 7, 8)]                       # main again 5-8
    events += [{"type": "snapshot", "name": "snap-8", "step": 8, "branch": "main", "kept": ["snap-8"]}]
    events += [{"type": "branch", "branch": "slow", "parent": "main", "step": 6, "from_step": 8,
                "abandoned": [7, 8], "changes": {"lr": 0.01}}]
    events += [train_(s, 30.0 - s) for s in (7, 8, 9)]                          # slow 7-9
    events += [{"type": "eval", "step": 9, "eval/loss": 2.5, "eval/exact_match": 0.5}]
    folder.events.write_text("".join(json.dumps(e) + "\n" for e in events))
    tree = BranchTree()
    tree.add("slow", "main", 6, str(checkpoints_dir(folder.root, "main") / "step-6"), {"lr": 0.01})
    tree.current = "slow"
    tree.save(folder.root)
    for branch, step in (("main", 2), ("main", 6), ("slow", 9)):
        ckpt = checkpoints_dir(folder.root, branch) / f"step-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "COMPLETE.json").write_text("{}")
    (checkpoints_dir(folder.root, "main") / "step-7").mkdir()  # unfinished: not a target

    view = branch_view(folder)
    loss = view.series["loss"]
    assert loss["loss · main"] == [(s, 10.0 - s) for s in range(1, 5)] + [(s, 20.0 - s) for s in (5, 6, 7, 8)]
    assert loss["loss · main (abandoned 1)"] == [(4, 6.0), (5, 5.0), (6, 4.0)]  # joined to where it left
    assert loss["loss · slow"] == [(6, 14.0), (7, 23.0), (8, 22.0), (9, 21.0)]  # starts at its fork
    assert loss["eval loss · slow"] == [(9, 2.5)] and view.series["eval"] == {"eval exact_match · slow": [(9, 0.5)]}
    assert set(view.series["lr"]) == {"lr · main", "lr · main (abandoned 1)", "lr · slow"}
    assert [(t.label, t.kind) for t in view.targets] == [
        ("step-6 (main)", "checkpoint"), ("step-2 (main)", "checkpoint"), ("step-9 (slow)", "checkpoint"),
        ("snapshot snap-8 (main, step 8)", "snapshot")]
    assert view.targets[-1].value == "snapshot:snap-8"
    lines = tree_lines(view)
    assert lines[0] == "main (steps 1-8)"
    assert lines[1] == "└ slow (steps 6-9): from step-6 of main at step 6, lr 0.01 ◀ training here"
    # the run ended: its snapshots went with its processes
    with folder.events.open("a") as f:
        f.write(json.dumps({"type": "state", "state": "finished"}) + "\n")
    assert [t.kind for t in branch_view(folder).targets] == ["checkpoint"] * 3


def test_the_data_view_follows_sources_draws_rewinds_and_the_inbox(tmp_path):
    from app.sources import data_view
    from contract.inbox import add_entry, forget_entry, inbox_path

    folder = RunFolder(tmp_path / "run").create()
    folder.config.write_text("data: {train: '', format: auto}\n")
    two = [{"name": "train", "weight": 1.0}, {"name": "extra", "weight": 0.5}]
    events = [{"type": "train", "step": s, "samples_per_source": {"train": 4}} for s in (1, 2)]
    events += [{"type": "snapshot", "name": "s2", "step": 2},
               {"type": "data", "step": 2, "change": "add", "sources": two}]
    events += [{"type": "train", "step": s, "samples_per_source": {"train": 3, "extra": 1}} for s in (3, 4)]
    events += [{"type": "rewind", "step": 2, "source": "snapshot:s2", "abandoned": [3, 4]},
               {"type": "train", "step": 3, "samples_per_source": {"train": 4}},
               {"type": "teach_check", "id": "t1", "step": 3, "old": "zzz", "new": "qux", "learned": True}]
    add_entry(inbox_path(folder.root), "t1", "capital: zorb", "qux", 2)
    add_entry(inbox_path(folder.root), "t2", "capital: blip", "bar", 2)
    forget_entry(inbox_path(folder.root), "t2", 3)
    view = data_view(folder, events)
    assert [s["name"] for s in view.sources] == ["train"]  # the rewind took the added source back
    assert view.seen["train"] == [(1, 4.0), (2, 8.0), (3, 12.0)]  # drawn again from step 2's position
    assert view.seen["extra"] == [(3, 1.0), (4, 2.0)]  # what the abandoned steps drew stays visible
    assert view.sources[0]["seen"] == 12 and view.sources[0]["path"] == "(the embedded default task)"
    assert [(e["id"], e["removed"], e["old"], e["new"], e["learned"]) for e in view.inbox] == [
        ("t1", False, "zzz", "qux", True), ("t2", True, None, None, None)]
    # the running run's own word on its sources wins
    assert [s["name"] for s in data_view(folder, events, live_sources=two).sources] == ["train", "extra"]


def test_a_warning_is_shown_under_its_field_and_a_problem_wins(backend, tmp_path):
    f = backend.form.field("data.max_length")
    warned = configure._help(f, [], ["about 3 of 7 rows are longer"])
    assert warned["info"].startswith("Warning: about 3 of 7 rows are longer — ") and "warned" in warned["elem_classes"]
    both = configure._help(f, ["must be at least 1"], ["about 3 of 7 rows are longer"])
    assert both["info"].startswith("⚠ must be at least 1 — Warning:") and "invalid" in both["elem_classes"]
    plain = configure._help(f, [])
    assert plain["elem_classes"] == ["cfg-field"] and not plain["info"].startswith(("⚠", "Warning"))


def test_the_status_line_shows_the_objectives_own_numbers(tmp_path):
    """A preference run's reward accuracy and margin, a GRPO run's mean reward, SFT's loss alone."""
    folder = RunFolder(tmp_path / "runs" / "r").create()
    info = RunInfo("r", str(folder.root), "running", True, 5, 100, {}, 1.0, None, None, None, None)

    def line(last: dict) -> str:
        return status_html(Snapshot(str(folder.root), info, Progress("running", 5, 100, 0, 10.0, 3.0, last, {}, None),
                                    1, None))
    dpo = line({"loss": 0.61, "rewards/accuracies": 0.75, "rewards/margins": 0.1234, "lr": 1e-4})
    assert "loss 0.6100 · reward acc 0.75 · margin 0.123 · lr 1.00e-04" in dpo
    assert "reward 0.420" in line({"loss": 0.01, "reward": 0.42})
    sft = line({"loss": 2.5})
    assert "loss 2.5000" in sft and "reward" not in sft and "margin" not in sft
