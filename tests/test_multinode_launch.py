"""Several machines: the launch command a hostfile gives, what is refused before anything starts,
and a real run whose hostfile names only this machine (through the DeepSpeed launcher's hostfile
path, without ssh)."""

import shutil

import pytest

from control_runs import launch, logs_of, losses, task_files, wait_exit
from contract.config.schema import ConfigError
from contract.config.load import load_config
from supervisor.launch import LaunchError, check_launchable, launch_command
from contract.run_folder import RunFolder


def hostfile(tmp_path, *lines: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text("# DeepSpeed hostfile\n" + "\n".join(lines) + "\n")
    return str(path)


def command(cfg, tmp_path) -> list[str]:
    return launch_command(cfg, RunFolder(tmp_path / "run"), python="python")


def test_localhost_hostfile_skips_only_the_ssh_check(tmp_path):
    cfg = load_config(overrides=["nproc=2", f"parallel.hostfile={hostfile(tmp_path, 'localhost slots=2')}",
                                 "parallel.master_port=29512"])
    cmd = command(cfg, tmp_path)
    assert cmd[:3] == ["python", "-m", "deepspeed.launcher.runner"]
    flags = " ".join(cmd)
    assert "--hostfile " + cfg.parallel.hostfile in flags and "--num_gpus 2" in flags
    assert "--master_addr 127.0.0.1 --master_port 29512" in flags
    assert "--no_ssh_check" in cmd and "--no_ssh" not in cmd
    assert cmd[-3:] == ["engine.worker", "--run-dir", str(tmp_path / "run")]
    assert cfg.world_size == 2
    check_launchable(cfg)  # nothing to ssh to


def test_two_machines(tmp_path):
    two = hostfile(tmp_path, "node-a slots=8", "node-b slots=8")
    with pytest.raises(ConfigError) as err:  # the other machine cannot reach 127.0.0.1
        load_config(overrides=["nproc=8", f"parallel.hostfile={two}"])
    assert "parallel.master_addr" in dict(err.value.problems)
    cfg = load_config(overrides=["nproc=8", "tp=2", f"parallel.hostfile={two}", "parallel.master_addr=10.0.0.1",
                                 "control.host=10.0.0.1"])  # a control address opted into explicitly
    assert (cfg.world_size, cfg.dp_size) == (16, 8)
    cmd = command(cfg, tmp_path)
    assert "--no_ssh_check" not in cmd and "--master_addr" in cmd and "10.0.0.1" in cmd
    if shutil.which("pdsh") is None:
        with pytest.raises(LaunchError, match="pdsh"):
            check_launchable(cfg)


def test_hostfile_problems_are_named(tmp_path):
    got = {}
    for lines, overrides in ((["localhost slots=1"], ["nproc=2"]),
                             (["localhost"], ["nproc=1"]),
                             (["localhost slots=2"], ["nproc=2", "parallel.launcher=torchrun"])):
        with pytest.raises(ConfigError) as err:
            load_config(overrides=[*overrides, f"parallel.hostfile={hostfile(tmp_path, *lines)}"])
        got.update(dict(err.value.problems))
    assert "parallel.nproc is 2" in got["parallel.nproc"] and "localhost slots=1" in got["parallel.nproc"]
    assert "not `HOST slots=N`" in got["parallel.hostfile"]
    assert "DeepSpeed launcher" in got["parallel.launcher"]
    with pytest.raises(ConfigError, match="control.host"):  # beyond loopback only with a hostfile
        load_config(overrides=["control.host=0.0.0.0"])


@pytest.mark.slow
def test_a_run_through_a_localhost_hostfile(tmp_path):
    task = task_files(tmp_path / "task")
    run = launch(tmp_path, "hosts", task, f"parallel.hostfile={hostfile(tmp_path, 'localhost slots=2')}",
                 "max_steps=12", "zero_stage=2", "control.enabled=false")
    assert wait_exit(run, timeout=400) == 0, logs_of(run)
    command_line = (run.folder.logs / "command.txt").read_text()
    assert "--hostfile" in command_line and "--no_ssh_check" in command_line
    launcher_log = (run.folder.logs / "launcher.log").read_text()
    assert "'localhost': [0, 1]" in launcher_log  # DeepSpeed's world info: this host, two ranks
    got = losses(run)
    assert sorted(got) == list(range(1, 13)) and got[12] < got[1]
