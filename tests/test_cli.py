"""The terminal front end end to end: `./launch.sh train` (`python -m app.cli train`) on the
embedded default, through the supervisor. A signal to the terminal's command stops its run the
way Stop does (save first) and leaves no process; a killed rank is named with its signal and its
last log lines, printed as text."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor.procs import group_alive

REPO = Path(__file__).resolve().parent.parent
# a short, cheap run of the embedded default (no evaluation, no tensorboard)
SMALL = ["data.max_length=32", "batch_size=8", "precision=fp32", "logging.tensorboard=false",
         "eval.every_n_steps=0", "eval.at_end=false", "checkpoint.save_at_end=false"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "train", *args]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache of the default task's assets for every run of this module (built once)."""
    return tmp_path_factory.mktemp("cache")


def run_cli(args, cache: Path, timeout=600):
    env = dict(os.environ, LIVETUNE_CACHE=str(cache))
    return subprocess.run(cli(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def events_of(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def group_of(pgid: int) -> list[psutil.Process]:
    """Every process (zombies too) of process group `pgid`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def start_cli(tmp_path: Path, cache: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    """The terminal command in the background (its own session, as a terminal would give it),
    output to a file; returns (process, run folder, output file)."""
    out = tmp_path / f"{name}.out"
    env = dict(os.environ, LIVETUNE_CACHE=str(cache))
    proc = subprocess.Popen(cli(f"output_dir={tmp_path / 'runs'}", f"run_name={name}", *SMALL, *args),
                            cwd=REPO, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, tmp_path / "runs" / name, out


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, out: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["type"] == "train" and e["step"] >= step for e in events_of(run_dir)):
            return
        if proc.poll() is not None:
            pytest.fail(f"the command ended early ({proc.returncode}):\n{out.read_text()}")
        time.sleep(0.2)
    end_everything(proc, run_dir)
    pytest.fail(f"no step {step} within {timeout} s:\n{out.read_text()}")


def runs_worker(proc: psutil.Process) -> bool:
    """Runs `python -m engine.worker` (the launchers name it after their own `-m ...`)."""
    argv = proc.cmdline()
    return "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["engine.worker"]


@pytest.fixture
def cleanup():
    """Commands a test started: they and their runs are ended after it, whatever happened."""
    started: list[tuple[subprocess.Popen, Path]] = []
    yield started
    for proc, run_dir in started:
        if proc.poll() is None or (run_dir / "launcher.pid").exists() and group_of(launcher_pid(run_dir)):
            end_everything(proc, run_dir)


def still_running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def launcher_pid(run_dir: Path) -> int:
    return int((run_dir / "launcher.pid").read_text())


def end_everything(proc: subprocess.Popen, run_dir: Path) -> None:
    """Leave nothing running behind a failed test, and nobody else's: a pid is signalled only while
    it is still ours (a Popen not yet reaped, a group that names the run folder); once a group is
    gone its number may lead a neighbour test worker's group."""
    groups = [proc.pid] if proc.returncode is None else []
    if (run_dir / "launcher.pid").exists() and group_alive(launcher_pid(run_dir), run_dir):
        groups.append(launcher_pid(run_dir))
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_default_run_end_to_end(tmp_path, cache):
    out = run_cli(["max_steps=30", f"output_dir={tmp_path / 'runs'}", "run_name=cli",
                   "eval.every_n_steps=15", "eval.max_samples=16"], cache)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = tmp_path / "runs" / "cli"
    for name in ("config.yaml", "events.jsonl", "logs/rank0.log", "logs/launcher.log"):
        assert (run_dir / name).exists(), name
    events = events_of(run_dir)
    train = [e for e in events if e["type"] == "train"]
    assert [e["step"] for e in train] == list(range(1, 31))
    for e in train:
        assert {"type", "step", "epoch", "loss", "lr", "tokens_per_s", "time"} <= set(e)
    first, last = sum(e["loss"] for e in train[:5]) / 5, sum(e["loss"] for e in train[-5:]) / 5
    assert last < first * 0.8, (first, last)
    evals = [e for e in events if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [15, 30]
    assert "eval/exact_match" in evals[-1] and "eval/loss" in evals[-1]
    assert events[-1]["type"] == "state" and events[-1]["state"] == "finished"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_bad_config_exits_nonzero_with_every_problem(tmp_path, cache):
    out = run_cli(["nproc=3", "tp=2", "train.nonsense=1", "optim.lr=fast"], cache, timeout=60)
    assert out.returncode == 2
    for words in ("parallel.nproc", "train.nonsense", "optim.lr", "3 problems"):
        assert words in out.stderr, out.stderr
    assert not (tmp_path / "runs").exists()


def test_missing_config_file(tmp_path, cache):
    out = run_cli([str(tmp_path / "nope.yaml")], cache, timeout=60)
    assert out.returncode == 2 and "file not found" in out.stderr


def test_help_names_the_stop_rule_and_detach(cache):
    out = run_cli(["--help"], cache, timeout=60)
    assert out.returncode == 0
    assert "--detach" in out.stdout and "saving a checkpoint and the final model first" in out.stdout
    bad = run_cli(["--nonsense"], cache, timeout=60)
    assert bad.returncode == 2 and "--nonsense" in bad.stderr


def test_log_lines_with_brackets_are_printed_as_text(capsys):
    from app.cli import print_failure
    from supervisor import Failure
    lines = ("[E ProcessGroupGloo.cpp:143] Gloo connectFullMesh failed with "
             "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed by peer",
             "[/__w/pytorch/third_party/gloo/pair.cc:537]", "[bold]not bold[/bold] [red]")
    failure = Failure("r", "rank_died", "rank 1 (pid 7) ended with signal SIGKILL [/x]", 1,
                      "/runs/r/logs/rank1.log", lines)
    print_failure(failure)  # rich would raise MarkupError on a closing tag that opens nothing
    err = capsys.readouterr().err
    assert "rank 1 (pid 7) ended with signal SIGKILL [/x]" in err
    assert "last lines of rank1.log" in err
    for line in lines:
        assert line in err


def test_warnings_and_failed_saves_of_a_run_are_printed(capsys):
    """A `warning` event and a `checkpoint_failed` event reach the terminal (as text: a path in
    brackets must not be taken for markup)."""
    from rich.progress import Progress

    from app.cli import _Shown
    with Progress(disable=True) as progress:
        shown = _Shown(progress, progress.add_task("training", total=10))
        shown.event({"type": "warning", "message": "loss is NaN at step 3 [/x]"})
        shown.event({"type": "checkpoint_failed", "kind": "save", "disk_full": True,
                     "error": "disk full at /runs/r/checkpoints/step-4: needs 9 MB, 1 MB free"})
    err = capsys.readouterr().err
    assert "warning: loss is NaN at step 3 [/x]" in err
    assert "checkpoint failed (save): disk full at /runs/r/checkpoints/step-4: needs 9 MB, 1 MB free" in err


@pytest.mark.slow
def test_a_signal_to_the_terminal_stops_the_run_with_its_save_and_leaves_nothing(tmp_path, cache, cleanup):
    """SIGHUP (the terminal closed) and SIGTERM (the command asked to end), each to a command of
    its own: the two are started at once (one test's wait, not two) and checked alike."""
    started = {sig: start_cli(tmp_path, cache, f"signalled-{sig.name}", "max_steps=5000")
               for sig in (signal.SIGHUP, signal.SIGTERM)}
    cleanup.extend((proc, run_dir) for proc, run_dir, _ in started.values())
    for proc, run_dir, out in started.values():
        wait_for_step(run_dir, proc, 2, out)
    for sig, (proc, run_dir, out) in started.items():
        stops_with_its_save_and_leaves_nothing(proc, run_dir, out, sig)


def stops_with_its_save_and_leaves_nothing(proc: subprocess.Popen, run_dir: Path, out: Path,
                                           sig: signal.Signals) -> None:
    pgid = launcher_pid(run_dir)
    members = group_of(pgid)
    assert len(members) >= 2, members  # the launcher and its rank

    os.kill(proc.pid, sig)
    try:
        code = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        end_everything(proc, run_dir)
        pytest.fail(f"the command did not end on {sig.name}:\n{out.read_text()}")
    text = out.read_text()
    assert code == 128 + sig, (sig.name, text)
    assert group_of(pgid) == [], f"processes of the run were left behind ({sig.name})"
    assert not [p for p in members if still_running(p)], sig.name

    events = events_of(run_dir)
    states = [e["state"] for e in events if e["type"] == "state"]
    assert states[-2:] == ["stopping", "finished"], (sig.name, states)
    stopped_at = [e for e in events if e["type"] == "state"][-2]["step"]
    saved = [e for e in events if e["type"] == "checkpoint"]
    assert saved and saved[-1]["step"] == stopped_at, (sig.name, saved)  # Stop's default: save first
    assert (run_dir / "checkpoints" / Path(saved[-1]["path"]).name).is_dir()
    assert "finished (stopped by the user)" in text, (sig.name, text)


@pytest.mark.slow
def test_a_killed_command_takes_its_run_with_it(tmp_path, cache, cleanup):
    """SIGKILL runs no handler: the run's launcher gets SIGTERM from the kernel instead (a
    parent-death signal) and ends its rank. Nothing can be saved then; nothing is left either."""
    proc, run_dir, out = start_cli(tmp_path, cache, "orphan", "max_steps=5000")
    cleanup.append((proc, run_dir))
    wait_for_step(run_dir, proc, 2, out)
    pgid = launcher_pid(run_dir)
    members = group_of(pgid)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while group_of(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_of(pgid) == [], "the run outlived its killed command"
    assert not [p for p in members if still_running(p)]


@pytest.mark.slow
def test_a_killed_rank_is_named_with_its_signal_and_last_log_lines(tmp_path, cache, cleanup):
    """Rank 0 killed: the rank that writes the run's state is gone, rank 1 fails on its lost peer
    (a network error of its own), the launcher ends the rest. The report names rank 0, not rank
    1's error nor no rank, carries rank 0's last log lines and records rank 0."""
    proc, run_dir, out = start_cli(tmp_path, cache, "killed", "nproc=2", "max_steps=5000")
    cleanup.append((proc, run_dir))
    wait_for_step(run_dir, proc, 2, out)
    pgid = launcher_pid(run_dir)
    rank0 = [p for p in group_of(pgid) if runs_worker(p) and p.environ().get("RANK") == "0"
             and not runs_worker(p.parent())]  # not a data-loader child of the rank
    assert len(rank0) == 1, "rank 0 not found"
    with open(run_dir / "logs" / "rank0.log", "a") as log:  # a line as gloo writes them
        log.write("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] read error\n")
    rank0[0].kill()
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        end_everything(proc, run_dir)
        pytest.fail(f"the command did not end:\n{out.read_text()}")
    text = out.read_text()
    assert code == 1, text
    assert "rank 0" in text and "SIGKILL" in text, text
    assert "last lines of rank0.log" in text and "pair.cc:537] read error" in text, text
    assert "MarkupError" not in text
    assert group_of(pgid) == []
    final = [e for e in events_of(run_dir) if e["type"] == "state"][-1]
    assert final["state"] == "failed" and final.get("rank") == 0, final


@pytest.mark.slow
def test_a_detached_run_outlives_its_command_is_listed_and_stopped_from_its_folder(tmp_path, cache, cleanup):
    from supervisor import RunManager
    proc, run_dir, out = start_cli(tmp_path, cache, "detached", "--detach", "max_steps=5000")
    cleanup.append((proc, run_dir))
    assert proc.wait(timeout=60) == 0, out.read_text()  # back at once: the run goes on
    assert "detached" in out.read_text() and str(run_dir) in out.read_text()
    deadline = time.monotonic() + 300
    while not any(e["type"] == "train" for e in events_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    [listed] = RunManager(tmp_path / "runs").list_runs()  # as the web app's run list sees it
    assert (listed.name, listed.state, listed.alive) == ("detached", "running", True)
    pgid = launcher_pid(run_dir)
    members = group_of(pgid)
    stop = subprocess.run([sys.executable, "-m", "app.cli", "stop", str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert stop.returncode == 0 and "finished" in stop.stderr, stop.stderr
    assert not [p for p in members if still_running(p)]
    deadline = time.monotonic() + 30  # the launcher is init's child now: reaped when init gets to it
    while group_of(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_of(pgid) == []
    states = [e["state"] for e in events_of(run_dir) if e["type"] == "state"]
    assert states[-2:] == ["stopping", "finished"]
    assert any(e["type"] == "checkpoint" for e in events_of(run_dir))  # Stop's default: save


def test_after_a_resume_the_outcome_is_the_resumed_runs(tmp_path, capsys):
    """A failure recorded before a resume in the same folder is history, not the outcome."""
    from app.cli import report
    from supervisor import RunManager
    run_dir = tmp_path / "runs" / "resumed"
    run_dir.mkdir(parents=True)
    events = [{"type": "state", "state": "starting"}, {"type": "state", "state": "running"},
              {"type": "state", "state": "failed", "error": "RuntimeError: unexpected pos 881216", "rank": 0},
              {"type": "state", "state": "starting"}, {"type": "resume", "step": 10},
              {"type": "state", "state": "running", "step": 10},
              {"type": "state", "state": "finished", "step": 20}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert report(RunManager(tmp_path / "runs").get("resumed")) == 0
    err = capsys.readouterr().err
    assert "finished" in err and "unexpected pos" not in err
