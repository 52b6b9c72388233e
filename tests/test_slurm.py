"""Slurm submission against a real Slurm (tests/slurm_cluster.py: munged, slurmctld and slurmd
on this machine, one node with 2 CPUs): `./launch.sh submit --slurm` (app.cli) writes the job
script into the run folder and submits it; the run is listed as queued / starting, then running;
the control plane answers once rank 0 wrote control.json; Stop scancels the job and confirms it
ended, with no process of it left; a job whose rank was killed shows its Slurm state and the
rank's last log lines."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from contract.config.load import load_config
from contract.run_folder import RunFolder
from slurm_cluster import SlurmUnavailable, check_available, slurm_cluster
from supervisor.client import RunClient
from supervisor.manager import RunManager
from supervisor.slurm import JobState, SlurmHandle, SlurmOptions, job_script, job_state, recorded_job, submit

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 400


def test_the_job_script_asks_for_what_the_options_say(tmp_path):
    cfg = load_config(overrides=["nproc=4", f"output_dir={tmp_path}"])
    folder = RunFolder(tmp_path / "run")
    script = job_script(cfg, folder, SlurmOptions(nodes=2, gpus_per_node=4, partition="gpu", time="2:00:00",
                                                  account="lab"), python="/venv/bin/python")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=2:00:00", "#SBATCH --account=lab",
                 f"#SBATCH --output={folder.logs}/slurm-%j.log"):
        assert line in script.splitlines()
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed 's/$/ slots=4/' > \"$RUN/hostfile\"" in script
    launch = script.splitlines()[-1]
    assert launch.startswith("srun --kill-on-bad-exit=1 --ntasks-per-node=1 /venv/bin/python -m torch.distributed.run")
    assert "--nnodes=\"$SLURM_JOB_NUM_NODES\" --nproc_per_node=4 --rdzv_backend=c10d" in launch
    assert launch.endswith("-m engine.worker --run-dir \"$RUN\"")
    assert "#SBATCH --cpus-per-task" not in script  # 0: Slurm's default
    with pytest.raises(ValueError, match="nodes must be >= 1"):
        SlurmOptions(nodes=0).check()


def test_a_job_slurm_has_forgotten_is_read_from_sacct(tmp_path, monkeypatch):
    """scontrol forgets a job MinJobAge after it ended; sacct (the accounting database, which
    needs slurmdbd and a database server: stand-ins here, printing what they print) still knows
    it. Without sacct, or without the job in it, the state is unknown (None)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1"),
                       ("sacct", 'case "$*" in *"-j 77 "*) echo "77|CANCELLED by 0|None|0:0|node-a";; esac')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{text}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert job_state("77") == JobState("77", "CANCELLED", "None", "0:0", "node-a")
    assert job_state("78") is None
    (bin_dir / "sacct").unlink()
    assert job_state("77") is None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        check_available()
        with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
            old = os.environ.get("SLURM_CONF")
            os.environ.update(env)
            try:
                yield env
            finally:
                if old is None:
                    os.environ.pop("SLURM_CONF", None)
                else:
                    os.environ["SLURM_CONF"] = old
    except SlurmUnavailable as e:
        pytest.skip(f"no Slurm here: {e}")


def run_processes(run_dir: Path) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if str(run_dir).encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_several_nodes_count_in_the_world_and_allow_a_reachable_control_socket(tmp_path):
    """A Slurm job of 2 nodes x 2 ranks is a world of 4 (the layout checks count it), and its rank 0
    may listen beyond loopback (opted into) so the submitting machine can reach it; the same
    config is refused where it cannot mean what it says."""
    from contract.config.schema import ConfigError
    from supervisor import RunManager, RunRefused
    cfg = load_config(overrides=["nproc=2", "parallel.nodes=2", "control.host=0.0.0.0", "tp=2",
                                 f"output_dir={tmp_path}"])
    assert (cfg.world_size, cfg.dp_size) == (4, 2)
    with pytest.raises(ConfigError, match="control.host: listening beyond loopback"):
        load_config(overrides=["nproc=2", "control.host=0.0.0.0"])
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=2\nb slots=2\n")
    with pytest.raises(ConfigError, match="parallel.nodes: the hostfile says"):
        load_config(overrides=[f"parallel.hostfile={hostfile}", "parallel.nodes=2"])
    with pytest.raises(RunRefused, match="is for a Slurm job"):  # not started here as 2 ranks
        RunManager(tmp_path / "runs").start(cfg)


@pytest.mark.slow
def test_submit_the_default_chat_pause_set_lr_and_stop(cluster, tmp_path):
    runs = tmp_path / "runs"
    got = subprocess.run([sys.executable, "-m", "app.cli", "submit", "--slurm", "--procs-per-node", "2",
                          "--partition", "debug", "--time", "30:00", f"output_dir={runs}", "run_name=slurm",
                          "max_steps=5000", "logging.tensorboard=false", "checkpoint.save_at_end=false"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    folder = RunFolder(runs / "slurm")
    job = recorded_job(folder)
    assert job and (folder.root / "job.sbatch").is_file()
    manager = RunManager(runs)
    handle = manager.get("slurm")
    assert isinstance(handle, SlurmHandle)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            (info,) = manager.list_runs()
            if not seen or seen[-1] != info.state:
                seen.append(info.state)
            if info.state == "running" and info.step >= 1:
                break
            assert info.state in ("queued", "starting", "running"), (info, handle.failure())
            time.sleep(0.5)
        assert seen[-1] == "running", (seen, handle.failure())
        assert seen[0] in ("queued", "starting"), seen
        assert "nodes" in (folder.root / "slurm_job.json").read_text()
        assert (folder.root / "hostfile").read_text().split() == [job_state(job).nodes, "slots=2"]
        with RunClient.connect(folder.root, timeout=60) as client:
            answer = client.generate("Hello", max_new_tokens=4, temperature=1.0, seed=1)
            pieces = list(answer)
            assert pieces and answer.result.text == "".join(pieces)
            assert client.pause().state == "paused"
            assert client.set(lr=2e-4).changes["lr"] == pytest.approx(2e-4)
            status = client.status()
            assert status.state == "paused" and status.world_size == 2
            assert status.settings["lr"] == pytest.approx(2e-4)
        stopped = manager.stop("slurm", save=False, timeout=120)
        assert stopped.state == "finished" and stopped.stopped_by_user, stopped
        ended = job_state(job)
        assert ended is not None and not ended.alive, ended
        deadline = time.monotonic() + 60
        while run_processes(folder.root) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not run_processes(folder.root), "processes of the job were left"
        print(f"\nSLURM states seen {seen}; job {job} ended {ended.state}")
    finally:
        subprocess.run(["scancel", job], capture_output=True)


@pytest.mark.slow
def test_a_failed_job_shows_its_slurm_state_and_the_rank_s_log(cluster, tmp_path):
    runs = tmp_path / "runs"
    cfg = load_config(overrides=[f"output_dir={runs}", "run_name=dies", "nproc=2", "max_steps=5000",
                                 "logging.tensorboard=false", "checkpoint.save_at_end=false"])
    folder = submit(cfg, runs, SlurmOptions(time="30:00"))
    job = recorded_job(folder)
    manager = RunManager(runs)
    handle = manager.get(folder.root.name)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while handle.info().step < 1:
            assert time.monotonic() < deadline and handle.info().state != "failed", handle.failure()
            time.sleep(0.5)
        (rank1,) = [p for p in run_processes(folder.root) if _is_rank(p, 1)]
        os.kill(rank1, 9)
        deadline = time.monotonic() + 120
        while (state := job_state(job)) is not None and state.alive and time.monotonic() < deadline:
            time.sleep(0.5)
        assert state is not None and state.state == "FAILED", state
        failure = handle.failure()
        # rank 0's lost-peer error is a victim's view: Slurm's word comes first
        assert failure is not None and failure.message.startswith(f"Slurm job {job} FAILED"), failure
        assert failure.lines, failure  # the failing rank's last log lines
        print(f"\nSLURM failed job reported: {failure.message[:200]}")
        assert not run_processes(folder.root)
    finally:
        subprocess.run(["scancel", job], capture_output=True)


@contextmanager
def queued_behind_a_full_node(cfg, runs: Path):
    """Submit the run while another job holds the whole node: it waits in the queue (Reason
    Resources) until the other job is cancelled (`release()`). Yields (folder, job, release)."""
    blocker = subprocess.run(["sbatch", "--parsable", "--exclusive", "--time=30:00", "--output=/dev/null",
                              "--wrap", "sleep 600"], capture_output=True, text=True, check=True).stdout.strip()
    job = None
    try:
        while (state := job_state(blocker)) is not None and state.pending:
            time.sleep(0.2)
        folder = submit(cfg, runs, SlurmOptions(time="30:00"))
        job = recorded_job(folder)
        state = job_state(job)
        assert state is not None and state.pending, state
        yield folder, job, lambda: subprocess.run(["scancel", blocker], capture_output=True)
    finally:
        subprocess.run(["scancel", blocker] + ([job] if job else []), capture_output=True)


def wait_job_ended(job: str, timeout: float = DEADLINE_S):
    deadline = time.monotonic() + timeout
    while (state := job_state(job)) is not None and state.alive and time.monotonic() < deadline:
        time.sleep(0.5)
    return state


def test_a_queued_job_stopped_from_the_terminal_is_cancelled_before_it_started(cluster, tmp_path):
    runs = tmp_path / "runs"
    cfg = load_config(overrides=[f"output_dir={runs}", "run_name=queued", "logging.tensorboard=false"])
    with queued_behind_a_full_node(cfg, runs) as (folder, job, _):
        assert RunManager(runs).get("queued").info().state == "queued"
        stop = subprocess.run([sys.executable, "-m", "app.cli", "stop", str(folder.root)], cwd=REPO,
                              capture_output=True, text=True, timeout=180)  # a plain stop: save by default
        said = stop.stdout + stop.stderr
        assert stop.returncode == 0, said
        assert "finished" in said and "cancelled before it started" in said and job in said, said
        info = RunManager(runs).get("queued").info()
        assert (info.state, info.stopped_by_user, info.error) == ("finished", True, None), info
        assert info.reason.startswith("cancelled before it started: Slurm job"), info
        ended = job_state(job)
        assert ended is not None and ended.state == "CANCELLED", ended


@pytest.mark.slow
def test_a_job_that_fails_at_start_reports_the_cause_first(cluster, tmp_path):
    """The job's ranks cannot load its config (its data file is gone by the time it starts):
    the report's first line is the problem, not "invalid run config (1 problem):"."""
    runs = tmp_path / "runs"
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    cfg = load_config(overrides=[f"output_dir={runs}", "run_name=nodata", f"data.train={data}",
                                 "logging.tensorboard=false"])
    with queued_behind_a_full_node(cfg, runs) as (folder, job, release):
        data.unlink()
        release()
        state = wait_job_ended(job)
        assert state is not None and state.state == "FAILED", state
        handle = RunManager(runs).get("nodata")
        failure = handle.failure()
        first = failure.message.splitlines()[0]
        assert first.startswith(f"data.train: no such file or folder: {data}"), failure.message
        assert f"Slurm job {job} FAILED" in first and "invalid run config" in first, first
        assert handle.info().error == failure.message  # the listing (web, notebook) says the same
        print(f"\nSLURM failed at start: {failure.message}")


def _is_rank(pid: int, rank: int) -> bool:
    """Whether `pid` is the worker of `rank` (not the torchrun agent, whose command also names it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
        if b"engine.worker" not in command or b"torch.distributed.run" in command:
            return False
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"RANK={rank}".encode() in f.read().split(b"\0")
    except OSError:
        return False
