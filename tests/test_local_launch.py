"""A one-machine run starts DeepSpeed's per-machine launcher directly (supervisor.launch), not
through its runner; a hostfile keeps the runner (tests/test_multinode_launch.py). The real
starts, stops and failures of such runs: tests/test_stop_everywhere.py, test_cli.py,
test_restart.py."""

import base64
import json

from contract.config.load import load_config
from contract.run_folder import RunFolder
from supervisor.launch import launch_command, local_launch_command


def test_one_machine_runs_the_launcher_directly(tmp_path):
    cfg = load_config(overrides=["nproc=2", "parallel.master_port=29513"])
    cmd = launch_command(cfg, RunFolder(tmp_path / "run"), python="python")
    assert cmd[:4] == ["python", "-u", "-m", "deepspeed.launcher.launch"]
    assert "deepspeed.launcher.runner" not in cmd
    world = next(a for a in cmd if a.startswith("--world_info="))
    assert json.loads(base64.urlsafe_b64decode(world.split("=", 1)[1])) == {"localhost": [0, 1]}
    assert "--master_addr=127.0.0.1" in cmd and "--master_port=29513" in cmd
    assert cmd[cmd.index("--module") + 1:] == ["engine.worker", "--run-dir", str(tmp_path / "run")]


def test_torchrun_is_unchanged(tmp_path):
    cfg = load_config(overrides=["nproc=2", "parallel.launcher=torchrun"])
    cmd = launch_command(cfg, RunFolder(tmp_path / "run"), python="python")
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]


def test_a_script_target(tmp_path):
    cmd = local_launch_command(3, 1234, ["x.py", "--flag"], python="py")
    assert cmd[-2:] == ["x.py", "--flag"] and "--module" not in cmd
    world = next(a for a in cmd if a.startswith("--world_info="))
    assert json.loads(base64.urlsafe_b64decode(world.split("=", 1)[1])) == {"localhost": [0, 1, 2]}
