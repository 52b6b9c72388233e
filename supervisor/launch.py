"""Start a run as its own supervised process group. Torch-free: the app and the CLI share it.

The launcher (DeepSpeed's or torchrun) and every rank live in one new session, so stopping a run
is one `killpg` and leaves no orphan. Output goes to log files in the run folder, never to a pipe
nobody drains.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from contract.config import RunConfig
from contract.layout_checks import is_local_only, parse_hostfile
from contract.run_folder import RunFolder

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_run_folder(cfg: RunConfig) -> RunFolder:
    """Create the run's folder (unique name) and write its resolved config there."""
    resumed = _run_of_checkpoint(cfg)
    if resumed is not None:  # resume=<run>/checkpoints/<name>: the run goes on in its own folder
        cfg.logging.output_dir = str(resumed.parent)
    name = cfg.logging.run_name or (resumed.name if resumed else datetime.now().strftime("run-%Y%m%d-%H%M%S"))
    root = Path(cfg.logging.output_dir) / name
    if root.exists() and (root / "events.jsonl").exists() and not cfg.resume:
        suffix = 2
        while (Path(cfg.logging.output_dir) / f"{name}-{suffix}").exists():
            suffix += 1
        root = Path(cfg.logging.output_dir) / f"{name}-{suffix}"
    cfg.logging.run_name = root.name
    folder = RunFolder(root.resolve()).create()
    folder.config.write_text(cfg.to_yaml())
    return folder


def _run_of_checkpoint(cfg: RunConfig) -> Path | None:
    """The run folder a `resume=` checkpoint path lies in (<run>/checkpoints/<name>, or
    <run>/checkpoints), when no run_name says otherwise and that folder holds a run."""
    value = cfg.resume
    if not value or value == "latest" or cfg.logging.run_name or "://" in value:
        return None
    path = Path(value).resolve()
    if path.name == "checkpoints":
        run = path.parent
    elif path.parent.name == "checkpoints":
        run = path.parent.parent
    else:
        return None
    return run if (run / "events.jsonl").exists() else None


def launch_command(cfg: RunConfig, folder: RunFolder, python: str = sys.executable) -> list[str]:
    """The command line that starts every rank of the run."""
    p = cfg.parallel
    port = p.master_port or free_port()
    worker = ["engine.worker", "--run-dir", str(folder.root)]
    if p.launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", f"--nproc_per_node={p.nproc}",
                f"--master_addr={p.master_addr}", f"--master_port={port}", "-m", *worker]
    cmd = [python, "-m", "deepspeed.launcher.runner", "--master_addr", p.master_addr,
           "--master_port", str(port), "--module"]
    if p.hostfile:
        # nproc ranks on each machine of the hostfile (the config's world size counts so)
        cmd += ["--hostfile", p.hostfile, "--num_gpus", str(p.nproc)]
        if is_local_only(parse_hostfile(Path(p.hostfile).read_text())[0]):
            # this machine alone: DeepSpeed starts it locally, but first checks passwordless
            # ssh to the host, which fails where no ssh server runs; skip only that check
            cmd.append("--no_ssh_check")
    else:  # one machine: no hostfile lookup, no ssh
        cmd += ["--num_gpus", str(p.nproc)]
    return cmd + worker


class LaunchError(RuntimeError):
    """The run cannot be started from this machine (a tool the launch needs is missing)."""


def check_launchable(cfg: RunConfig) -> None:
    """Refuse, with the reason, a launch that would fail inside DeepSpeed's launcher: several
    machines are started over ssh with pdsh (DeepSpeed's default multi-node backend)."""
    p = cfg.parallel
    if not p.hostfile:
        return
    hosts, _ = parse_hostfile(Path(p.hostfile).read_text())
    if not is_local_only(hosts) and shutil.which("pdsh") is None:
        raise LaunchError(f"parallel.hostfile names {len(hosts)} machines; DeepSpeed starts them with "
                          "pdsh over passwordless ssh, and pdsh is not installed here (apt-get install "
                          "pdsh), or start each machine yourself: see the README, 'Several machines'")


@dataclass
class LaunchedRun:
    folder: RunFolder
    process: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.process.pid


def spawn(cfg: RunConfig, folder: RunFolder, extra_env: dict | None = None) -> LaunchedRun:
    """Start the run's launcher in a new session; its output goes to logs/launcher.log."""
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "LIVETUNE_RUN_DIR": str(folder.root)})
    # Each rank gets an equal share of the cores; oversubscribing threads slows gloo ranks badly.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.parallel.nproc)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra_env or {})
    check_launchable(cfg)
    cmd = launch_command(cfg, folder)
    folder.logs.mkdir(parents=True, exist_ok=True)
    (folder.logs / "command.txt").write_text(" ".join(cmd) + "\n")
    log = open(folder.logs / "launcher.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=str(REPO_ROOT), env=env, start_new_session=True)
    log.close()
    (folder.root / "launcher.pid").write_text(str(proc.pid))
    return LaunchedRun(folder, proc)


def kill_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the whole process group, then SIGKILL what is left after `grace_s`."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not group_alive(pgid):
                return
            time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a group whose members are all zombies is gone for our purposes
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            stat = (pid_dir / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
