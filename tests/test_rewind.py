"""Rewind, branch and snapshot in place on 2 ranks (tests/scripts/rewind_check.py), several layouts
in one launch to keep CI short. Each layout's run, driven through the control plane's real path:

    1..6, snapshot s2 at 2, step-4 saved at 4 | rewind s2 -> 3..6 | rewind 4 -> 5..8 |
    branch b from step-4 -> 5..9

(the first layout sends its commands through RunClient.rewind / branch / snapshot
over the control socket; the others put them straight into rank 0's queue)
Every repeated step must give the very loss of its first run (bit for bit): a rewind to a
snapshot, a rewind to a checkpoint and a branch with no setting changed all repeat the original
trajectory. Refusals (unknown checkpoint, a taken branch name, another layout's checkpoint) leave
the run unchanged -- it still repeats exactly. Then the run folder: the tree, b's own checkpoints,
main's fork checkpoint kept, the events (abandoned ranges, the branch's history alone and from the
root), and resume=main continuing main from its newest checkpoint in a new Trainer.
A DPO run (full fine-tuning under ZeRO-3: its frozen reference is a partitioned engine beside the
policy's) repeats its reward metrics as well, and its reference stays the initial model throughout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from contract.branches import ROOT, BranchTree, branch_events, path_events
from dist_utils import SCRIPTS, parse_results, run_deepspeed

STEPS = [1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 5, 6, 7, 8, 5, 6, 7, 8, 9, 9]
# Each layout after another one, whose checkpoint it must refuse: another layout's, and for
# adalomo lomo's (the same layout, another method). All in one launch (a 2-rank start costs more
# than a layout's steps); tp2 after every layout without tensor parallelism: a tensor-parallel
# engine leaves DeepSpeed's process-wide model-parallel groups behind, which a later engine
# without them cannot be built beside (one run is one layout; only this test builds several).
LAYOUTS = "zero0,zero2,zero3,lora,dpo,lomo,adalomo,tp2,pp2"
SAME_LAYOUT_AS_BEFORE = {"adalomo"}


def check_sequence(seen: list) -> dict[int, float]:
    """Each (step, loss, next step's lr) repeats its first occurrence exactly."""
    assert [s for s, _, _ in seen] == STEPS
    first: dict[int, list] = {}
    for step, loss, lr in seen[:-1]:
        first.setdefault(step, [loss, lr])
        assert [loss, lr] == first[step], f"step {step}: {loss, lr} after a rewind, {first[step]} at first"
    assert first[9][0] < first[1][0]  # it trains
    assert seen[-1][:2] == [9, first[9][0]]  # branch c: b's step 8 again, then step 9 at half the rate
    return {step: loss for step, (loss, _) in first.items()}


def check_preference(path: str) -> None:
    """A preference run's rewinds and branches repeat each step's reward metrics exactly too
    (the last, c's step 9 at half the rate, is b's step 9 again: the metrics come before the
    update), and its frozen reference stays the initial model: its weights on each rank are the
    policy's before the first step, after every step (no rewind or branch loads the policy's
    checkpoint into it). (The rewards of step 1 are not 0: the task's model has attention dropout,
    a config value that TRL's disable_dropout, and ours, leave on in the policy's forward.)"""
    kept = json.loads(Path(path).read_text())
    metrics, reference = kept["metrics"], kept["reference"]
    assert len(metrics) == len(reference) == len(STEPS)
    first: dict[int, dict] = {}
    for step, values in zip(STEPS, metrics):
        assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"} <= set(values), values
        first.setdefault(step, values)
        assert values == first[step], f"step {step}: {values} after a rewind, {first[step]} at first"
    assert set(reference) == set(kept["initial"]), "the reference is not the initial model at every step"
    assert first[9]["rewards/margins"] > 0  # it learns to prefer the chosen answers


def check_replies(replies: list, layout: str, other: bool) -> None:
    """The refusals and each command's result (the first layout's came back through RunClient)."""
    by_id = {}
    for r in replies:
        by_id.setdefault(r["id"], []).append(r)
    errors = [r["error"] for r in by_id.pop("1-rewind") + by_id.pop("1-branch")]
    assert len(errors) == (3 if other else 2), errors
    assert any("no checkpoint of step 99 on branch 'main'" in e and "snapshots: none" in e for e in errors)
    assert any("branch 'main' exists already" in e for e in errors)
    if other and layout in SAME_LAYOUT_AS_BEFORE:  # the previous method's checkpoint
        assert any("holds another model or method" in e and "method: checkpoint 'lomo'" in e for e in errors), errors
    elif other:  # the previous layout's checkpoint: both layouts named, nothing loaded
        assert any("was written by" in e and "this run is" in e for e in errors), errors
    assert by_id["2-snapshot"][0]["step"] == 2 and by_id["2-snapshot"][0]["bytes"] > 0
    assert {k: by_id["6-rewind"][0][k] for k in ("step", "from_step", "abandoned")} == \
        {"step": 2, "from_step": 6, "abandoned": [3, 6]}
    assert by_id["10-rewind"][0]["abandoned"] == [5, 6]
    assert {k: by_id["14-branch"][0][k] for k in ("step", "branch", "parent", "abandoned")} == \
        {"step": 4, "branch": "b", "parent": ROOT, "abandoned": [5, 8]}
    c = by_id["19-branch"][0]  # from b's own step-8, with a setting changed in the same command
    assert (c["step"], c["branch"], c["parent"], c["abandoned"], c["set"]) == (8, "c", "b", [9, 9], {"lr_scale": 0.5})
    tree = by_id["20-branches"][0]
    assert tree["current"] == "c" and tree["tree"] == {ROOT: [None, 0], "b": [ROOT, 4], "c": ["b", 8]}
    # what c can go back to: main up to b's fork (4), b up to c's fork (8)
    assert tree["checkpoints"] == {ROOT: ["step-4"], "b": ["step-8"], "c": []}
    assert tree["snapshots"] == ["s2"]


def check_folder(folder: Path, current: str = "c") -> None:
    tree = BranchTree.load(folder)
    assert tree.current == current and tree.ancestry("c") == [ROOT, "b", "c"] and tree.branches["b"].fork_step == 4
    assert tree.branches["c"].settings == {"lr_scale": 0.5}
    assert (folder / "checkpoints" / "step-4" / "COMPLETE.json").exists()  # the fork point stays
    assert (folder / "branches" / "b" / "checkpoints" / "step-8" / "COMPLETE.json").exists()
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    kinds = [e["type"] for e in events]
    assert kinds.count("rewind") == 2 and kinds.count("branch") == 2 and kinds.count("snapshot") == 1
    own = [e["step"] for e in branch_events(events, "b") if e["type"] == "train"]
    assert own == [5, 6, 7, 8, 9]
    assert [e["step"] for e in path_events(events, "b", tree) if e["type"] == "train"] == list(range(1, 10))
    path_c = [(e["step"], e.get("branch", ROOT)) for e in path_events(events, "c", tree) if e["type"] == "train"]
    assert path_c == [(s, ROOT) for s in range(1, 5)] + [(s, "b") for s in range(5, 9)] + [(9, "c")]
    sets = [e for e in branch_events(events, "c") if e["type"] == "set"]
    assert len(sets) == 1 and sets[0]["changes"]["lr_scale"] == 0.5


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rewind_branch_and_snapshot_repeat_the_losses(tmp_path):
    layouts = LAYOUTS.split(",")
    proc = run_deepspeed(SCRIPTS / "rewind_check.py", nproc=2,
                         args=("--layouts", LAYOUTS, "--out", str(tmp_path), "--resume-branch"), timeout=1500)
    results = parse_results(proc)
    for i, layout in enumerate(layouts):
        ranks = sorted((r for r in results if r["layout"] == layout), key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1], layout
        assert ranks[0]["seen"] == ranks[1]["seen"] and ranks[0]["branch"] == "c"
        first = check_sequence(ranks[0]["seen"])
        if "preference" in ranks[0]:  # each rank's own reference partition
            for rank in ranks:
                check_preference(rank["preference"])
        check_replies(ranks[0]["replies"], layout, other=i > 0)
        resumed_too = i == 0  # resume=main went on in main
        check_folder(Path(ranks[0]["folder"]), ROOT if resumed_too else "c")
        if resumed_too:
            resumed = [r for r in results if r["layout"] == f"{layout}-resumed"]
            assert len(resumed) == 2 and all(r["branch"] == ROOT for r in resumed)
            # main's step-8 is the weights branch b reached at its step 8: the same step 9
            assert resumed[0]["seen"] == [[9, first[9]]]
            folder = Path(ranks[0]["folder"])
            assert (folder / "checkpoints" / "step-9" / "COMPLETE.json").exists()
            events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
            resume = [e for e in events if e["type"] == "resume"]
            assert len(resume) == 1 and resume[0]["branch"] == ROOT and resume[0]["step"] == 8
            main = [e["step"] for e in branch_events(events, ROOT) if e["type"] == "train"]
            assert main == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 5, 6, 7, 8, 9]


def test_rewind_is_refused_while_a_save_goes_on():
    from engine.checkpoint import rewind, state

    with state.saving("runs/r/checkpoints/step-8"):
        with pytest.raises(rewind.RewindError, match=r"a save is going on \(runs/r/checkpoints/step-8\); rewind once"):
            rewind.rewind_in_place(object(), "step-4")  # refused before it looks at the run
    assert state.SAVING == []


def test_rewind_stays_on_the_present_branch(tmp_path):
    """A rewind goes back along the present branch; another branch's state, or an ancestor's after
    the fork, is refused before anything is loaded (branch goes on from those)."""
    from types import SimpleNamespace

    from contract.config.schema import RunConfig
    from contract.run_folder import RunFolder
    from engine.checkpoint import rewind, snapshots

    tree = BranchTree()
    tree.add("b", ROOT, 4, "x")
    tree.add("c", ROOT, 6, "y")
    tree.current = "b"
    tree.save(tmp_path)
    store = snapshots.SnapshotStore(keep=3, max_mib=0)
    store.snapshots = [snapshots.Snapshot(name, step, branch, tmp_path, {}, {}, {}, None)
                       for name, step, branch in (("on-c", 7, "c"), ("main-5", 5, ROOT), ("main-3", 3, ROOT))]
    trainer = SimpleNamespace(folder=RunFolder(tmp_path, branch="b"), config=RunConfig(), snapshots=store,
                              state=SimpleNamespace(global_step=9), events=None)
    with pytest.raises(rewind.RewindError, match=r"snapshot 'on-c' belongs to branch 'c', which is not on the "
                                                 r"path of the present branch 'b' \(main > b\); use branch"):
        rewind.rewind_in_place(trainer, "on-c")
    with pytest.raises(rewind.RewindError, match="is step 5 of branch 'main', after branch 'b' forked from it at step 4"):
        rewind.rewind_in_place(trainer, "snapshot:main-5")
    with pytest.raises(rewind.RewindError, match=r"no snapshot named 'zz' \(kept: on-c, main-5, main-3\)"):
        rewind.rewind_in_place(trainer, "snapshot:zz")
    with pytest.raises(rewind.RewindError, match="no checkpoint of step 3 on branch 'b' or its ancestors; "
                                                 r"checkpoints \(main: none; b: none\); snapshots: main-3"):
        rewind.rewind_in_place(trainer, "3")
    rewind._check_on_path(trainer, "snapshot:main-3", ROOT)  # before the fork: on b's path
    assert rewind.available(trainer) == {"checkpoints": {ROOT: [], "b": []}, "snapshots": ["main-3"]}


def test_snapshots_stay_within_their_bounds(tmp_path):
    """The oldest snapshots go first, by count and by memory; their folders go with them."""
    from engine.checkpoint.agreement import Comm
    from engine.checkpoint.snapshots import Snapshot, SnapshotError, SnapshotStore

    def snap(name: str, mib: float) -> Snapshot:
        (tmp_path / name).mkdir()
        return Snapshot(name, 1, ROOT, tmp_path / name, {}, {}, {}, None, bytes=int(mib * 2**20))

    store = SnapshotStore(keep=2, max_mib=0)
    store.snapshots = [snap("a", 1), snap("b", 1), snap("c", 1)]
    assert store._evict(Comm()) == ["a"] and store.names() == ["b", "c"] and not (tmp_path / "a").exists()
    store = SnapshotStore(keep=5, max_mib=2)
    store.snapshots = [snap("d", 0.75), snap("e", 0.75), snap("f", 0.75)]
    assert store._evict(Comm()) == ["d"] and store.total_bytes() == int(1.5 * 2**20)
    with pytest.raises(SnapshotError, match="snapshots_keep is 0, so snapshots are off"):
        SnapshotStore(keep=0, max_mib=0).take(None, "x", ROOT, {}, None)  # refused before it looks at the run


def test_snapshot_folders_of_dead_processes_are_swept(tmp_path):
    import subprocess
    import sys

    from engine.checkpoint.snapshots import PREFIX, sweep_stale

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = tmp_path / f"{PREFIX}{gone.stdout.strip()}-abc", tmp_path / f"{PREFIX}{os.getpid()}-def"
    for folder in (dead, alive, tmp_path / f"{PREFIX}oldname"):
        (folder / "s").mkdir(parents=True)
    assert sweep_stale(tmp_path) == [dead.name]
    assert alive.exists() and (tmp_path / f"{PREFIX}oldname").exists() and not dead.exists()


def test_a_restored_state_puts_the_runs_own_clipping_back():
    """Live settings restored from before a `set grad_clip` (None: not changed) put the engine's
    clipping back to the run's value; a recorded change is put in."""
    from types import SimpleNamespace

    from contract.config.schema import RunConfig
    from engine.control.handlers import apply_settings
    from engine.control.settings import LiveSettings

    class Engine:  # what ds_config.set_gradient_clipping and the handler touch of a DeepSpeed engine
        def __init__(self):
            self._config, self.optimizer = SimpleNamespace(gradient_clipping=0.5), SimpleNamespace(clip_grad=0.5)

        def gradient_clipping(self):
            return self._config.gradient_clipping

    from engine.model.methods import FullMethod, FusedMethod

    engine = Engine()  # a `set grad_clip=0.5` happened after the state being restored was saved
    run = SimpleNamespace(engine=engine, optimizer=None)
    control = SimpleNamespace(settings=LiveSettings(), trainer=SimpleNamespace(
        engine=engine, ctx=run, method=FullMethod(), config=RunConfig(),
        ds_setup=SimpleNamespace(config={"gradient_clipping": 1.0})))
    apply_settings(control)
    assert engine._config.gradient_clipping == 1.0 and engine.optimizer.clip_grad == 1.0
    control.settings.load_state_dict({"grad_clip": 0.25})
    apply_settings(control)
    assert engine.gradient_clipping() == 0.25 and engine.optimizer.clip_grad == 0.25
    # LOMO / AdaLomo clip inside their fused update, with their own norm: that is what changes
    fused = SimpleNamespace(max_grad_norm=1.0)
    control.trainer.method, run.optimizer = FusedMethod("lomo"), fused
    apply_settings(control)
    assert fused.max_grad_norm == 0.25 and control.trainer.method.grad_clip(run) == 0.25
