"""Several machines, before anything starts: which environment variables reach the ranks on the
other machines (the file DeepSpeed's launcher exports there), OMP_NUM_THREADS from each machine's
own cores, a hostfile whose slots= disagree with parallel.nproc refused naming both, and a
failure's last lines without the harmless c10d line. No process started but a shell; the real
two-host run: tests/test_two_hosts.py."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.run_folder import RunFolder
from contract.config.layout_checks import hostfile_problems
from supervisor.launch import FORWARDED_PREFIXES, threads_per_rank_on_each_host, write_remote_env
from supervisor.records import log_tail


def deepspeed_export_prefixes() -> list[str]:
    """EXPORT_ENVS of the installed DeepSpeed's runner, read from its source (no torch import)."""
    spec = importlib.util.find_spec("deepspeed")
    source = (Path(spec.origin).parent / "launcher" / "runner.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EXPORT_ENVS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("EXPORT_ENVS not found in deepspeed/launcher/runner.py")


def exported(path: Path) -> dict[str, str]:
    """What a machine's shell gets from the env file, exported as DeepSpeed's runner does it
    (multinode_runner.add_export: a value with other characters than [\\w@%+=:,./-] is
    double-quoted; the pdsh command is `export K=V; ...`)."""
    lines = [ln.split("=", 1) for ln in path.read_text().splitlines()]
    quoted = [(k, v if all(c.isalnum() or c in "_@%+=:,./-" for c in v) else f'"{v}"') for k, v in lines]
    script = "".join(f"export {k}={v}; " for k, v in quoted) + "env -0"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={"PATH": os.environ["PATH"]},
                         check=True).stdout
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def test_deepspeed_s_own_prefixes_and_the_network_settings_are_forwarded(tmp_path, monkeypatch):
    monkeypatch.setattr(Path, "home", lambda: tmp_path)  # no ~/.deepspeed_env of the machine's user
    assert set(deepspeed_export_prefixes()) <= set(FORWARDED_PREFIXES)
    launching = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "ib0", "NCCL_DEBUG": "INFO",
                 "UCX_TLS": "rc,sm", "TP_SOCKET_IFNAME": "eth1", "PYTHONFAULTHANDLER": "1",
                 "NCCL_ODD": 'a"b', "HOME": "/root", "PATH": "/here/bin", "SECRET_TOKEN": "x"}
    (tmp_path / ".deepspeed_env").write_text("MY_OWN=kept\n")
    path = write_remote_env(RunFolder(tmp_path), {"LIVETUNE_RUN_DIR": "/runs/r"}, launching, nproc=2)
    got = exported(path)
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "UCX_TLS", "TP_SOCKET_IFNAME",
                "PYTHONFAULTHANDLER"):
        assert got[key] == launching[key], key
    assert got["MY_OWN"] == "kept" and got["LIVETUNE_RUN_DIR"] == "/runs/r"
    for key in ("HOME", "SECRET_TOKEN", "NCCL_ODD"):  # not forwarded; a value the export would break
        assert got.get(key) != launching[key], key
    assert got["PATH"] == os.environ["PATH"]  # each machine's own
    # OMP_NUM_THREADS: this "machine's" shell works it out from its own cores
    assert got["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))


def test_a_loopback_interface_setting_does_not_reach_the_other_machines(tmp_path, monkeypatch):
    """A process that ran a one-machine run in-process has GLOO_SOCKET_IFNAME=lo (engine.parallel.rendezvous
    sets it): forwarded, every rank would advertise 127.0.0.1 to the others, and gloo's full mesh
    would fail with "Connection refused, remote=[127.0.0.1]"."""
    monkeypatch.setattr(Path, "home", lambda: tmp_path)
    launching = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo", "TP_SOCKET_IFNAME": "lo,lo0",
                 "NCCL_DEBUG": "INFO"}
    got = exported(write_remote_env(RunFolder(tmp_path), {}, launching, nproc=1))
    assert not {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"} & set(got)
    assert got["NCCL_DEBUG"] == "INFO"  # the rest still goes


def test_a_user_s_omp_num_threads_is_kept(tmp_path):
    path = write_remote_env(RunFolder(tmp_path), {"OMP_NUM_THREADS": "3"}, {}, nproc=2)
    assert exported(path)["OMP_NUM_THREADS"] == "3"
    assert "nproc" in threads_per_rank_on_each_host(4)


def hostfile(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_slots_that_disagree_with_nproc_are_refused_before_launch_naming_both(tmp_path):
    for nproc, slots in ((1, 2), (2, 1)):  # more slots than ranks, and fewer: refused alike
        with pytest.raises(ConfigError) as refused:
            load_config(overrides=[f"nproc={nproc}", f"parallel.hostfile={hostfile(tmp_path, f'localhost slots={slots}')}",
                                   f"output_dir={tmp_path / 'runs'}"])
        message = str(refused.value)
        assert f"parallel.nproc is {nproc}" in message and f"localhost slots={slots}" in message
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing started
    equal = load_config(overrides=["nproc=2", f"parallel.hostfile={hostfile(tmp_path, 'localhost slots=2')}"])
    assert hostfile_problems(equal) == []


def test_the_harmless_c10d_line_is_left_out_of_a_failure_s_last_lines(tmp_path):
    folder = RunFolder(tmp_path)
    folder.logs.mkdir(parents=True)
    harmless = "[W1204 20:40:01.1 socket.cpp:752] [c10d] The hostname of the client socket cannot be retrieved. err=-3"
    folder.rank_log(1).write_text("\n".join(["step 3", harmless, "Traceback (most recent call last):",
                                             "RuntimeError: Connection reset by peer", harmless]) + "\n")
    _, lines = log_tail(folder, 1, 3)
    assert lines == ("step 3", "Traceback (most recent call last):", "RuntimeError: Connection reset by peer")
