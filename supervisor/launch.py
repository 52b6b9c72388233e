"""Start a run as its own supervised process group. Torch-free: the app and the CLI share it.

The launcher (DeepSpeed's or torchrun) and every rank live in one new session, so stopping a run
is one `killpg` and leaves no orphan. Output goes to log files in the run folder, never to a pipe
nobody drains.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from contract.config.schema import RunConfig
from contract.config.layout_checks import is_local_only, parse_hostfile
from contract.run_folder import RunFolder

from supervisor import remote_stop
from supervisor.remote import LAUNCH_MARKER

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_command(cfg: RunConfig, folder: RunFolder, python: str = sys.executable) -> list[str]:
    """The command line that starts every rank of the run."""
    p = cfg.parallel
    port = p.master_port or free_port()
    worker = ["engine.worker", "--run-dir", str(folder.root)]
    if p.launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", f"--nproc_per_node={p.nproc}",
                f"--master_addr={p.master_addr}", f"--master_port={port}", "-m", *worker]
    if not p.hostfile:  # one machine: its launcher directly, without DeepSpeed's runner
        return local_launch_command(p.nproc, port, ["--module", *worker], python=python)
    cmd = [python, "-m", "deepspeed.launcher.runner", "--master_addr", p.master_addr,
           "--master_port", str(port), "--module"]
    # nproc ranks on each machine of the hostfile (the config's world size counts so)
    cmd += ["--hostfile", p.hostfile, "--num_gpus", str(p.nproc)]
    if is_local_only(parse_hostfile(Path(p.hostfile).read_text())[0]):
        # this machine alone: DeepSpeed starts it locally, but first checks passwordless
        # ssh to the host, which fails where no ssh server runs; skip only that check
        cmd.append("--no_ssh_check")
    return cmd + worker


def local_launch_command(nproc: int, port: int, target: list[str], python: str = sys.executable) -> list[str]:
    """DeepSpeed's per-machine launcher (`deepspeed.launcher.launch`: starts the ranks, sets
    RANK / LOCAL_RANK / WORLD_SIZE, appends `--local_rank=N`, ends them all when one fails or it
    gets SIGTERM) for `nproc` ranks on this machine, running `target` (a script and its
    arguments, or `--module NAME ARGS`).

    It is the command DeepSpeed's runner (`deepspeed --num_gpus N`) builds and starts for a
    one-machine job, the host's slots encoded as `--world_info`, the rendezvous on 127.0.0.1 (the
    runner's own choice without a hostfile). Started directly, the runner in front of it goes:
    a Python process that imports deepspeed (~2.3 s of CPU per launch) only to build this line.
    What changes: launcher.log has no `[runner.py] cmd = ` line (spawn writes LAUNCH_MARKER), and
    a group ended by SIGTERM leaves a launcher that exits 1 (launch.py's handler) where the
    runner died by the signal; the supervisor tells a stop from a failure by the stop it asked
    for (supervisor.stopping, the stop marker), never by that code."""
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nproc))}).encode()).decode()
    return [python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
            "--master_addr=127.0.0.1", f"--master_port={port}", *target]


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


def runs_on_other_machines(cfg: RunConfig) -> bool:
    """Whether DeepSpeed's launcher starts ranks over ssh (a hostfile naming other machines)."""
    p = cfg.parallel
    return bool(p.hostfile) and p.launcher == "deepspeed" and not is_local_only(
        parse_hostfile(Path(p.hostfile).read_text())[0])


# What reaches the ranks on the other machines from the launching machine's environment: the
# prefixes DeepSpeed's own runner forwards (deepspeed/launcher/runner.py EXPORT_ENVS, plus NCCL,
# which its CUDA accelerator adds), and the network settings of torch.distributed's backends.
FORWARDED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL", "GLOO_", "TP_SOCKET_IFNAME",
                      "TORCH_NCCL_", "TORCH_GLOO_", "TORCH_DISTRIBUTED_DEBUG", "FI_")
# Characters that a value cannot hold through DeepSpeed's `export KEY="VALUE";` over pdsh.
_UNSAFE = re.compile(r'["`$\\\n]')


def forwarded(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` that go to the other machines (see FORWARDED_PREFIXES), less an
    interface setting that names the loopback interface: ranks on several machines cannot meet
    there, and our own engine sets GLOO_SOCKET_IFNAME=lo in a process that ran a one-machine run
    in-process (engine.parallel.rendezvous; a notebook or a script that later launches across machines)."""
    return {k: v for k, v in env.items()
            if k.startswith(FORWARDED_PREFIXES) and not _UNSAFE.search(v) and not _loopback_interface(k, v)}


def _loopback_interface(key: str, value: str) -> bool:
    """`value` of a *_SOCKET_IFNAME variable names only loopback interfaces ("lo", "=lo", "lo,lo0")."""
    return key.endswith("SOCKET_IFNAME") and all(
        name.lstrip("=").startswith("lo") for name in value.split(",") if name)


def threads_per_rank_on_each_host(nproc: int) -> str:
    """OMP_NUM_THREADS as a shell expression each machine evaluates for itself: its own cores
    shared by its `nproc` ranks (DeepSpeed exports it as `export OMP_NUM_THREADS="...";`)."""
    return f"$(( $(nproc) / {nproc} > 1 ? $(nproc) / {nproc} : 1 ))"


def write_remote_env(folder: RunFolder, run_env: dict[str, str], env: dict[str, str] | None = None,
                     nproc: int = 1) -> Path:
    """The run's environment for the ranks on other machines, in the file DS_ENV_FILE names,
    whose KEY=VALUE lines DeepSpeed's launcher exports on every machine (pdsh carries no
    environment): the user's own ~/.deepspeed_env (which DS_ENV_FILE replaces), the forwarded
    variables of the launching environment `env`, then the run's own. PATH stays each
    machine's own; OMP_NUM_THREADS, unless `run_env` sets it (the user did), comes from each
    machine's own cores."""
    lines = []
    own = Path.home() / ".deepspeed_env"
    if own.is_file():
        lines += [ln for ln in own.read_text().splitlines() if "=" in ln]
    values = {**forwarded(env or {}), **run_env}
    values.setdefault("OMP_NUM_THREADS", threads_per_rank_on_each_host(nproc))
    lines += [f"{key}={value}" for key, value in values.items() if key != "PATH" and "\n" not in value]
    path = folder.root / "deepspeed_env"
    path.write_text("".join(ln + "\n" for ln in lines))
    return path


@dataclass
class LaunchedRun:
    folder: RunFolder
    process: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.process.pid


def spawn(cfg: RunConfig, folder: RunFolder, extra_env: dict | None = None,
          die_with_parent: bool = False, from_any_thread: bool = False) -> LaunchedRun:
    """Start the run's launcher in a new session; its output goes to logs/launcher.log.
    `die_with_parent`: the whole group is ended when the thread that started it ends, even by
    SIGKILL (`supervisor.guard` leads the group): for a run owned by its terminal. Call it from
    the main thread then (Linux ties the parent-death signal to the creating thread), or with
    `from_any_thread` (a restart, started by the thread that ended the failed group): the guard
    then watches this process instead, by its parent's pid."""
    env = dict(os.environ)
    # offline unless the caller's environment allows the hub (a model by hub ID: contract.hub)
    run_env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
               "TOKENIZERS_PARALLELISM": "false",
               "LIVETUNE_RUN_DIR": str(folder.root)}
    # Each rank gets an equal share of the cores; oversubscribing threads slows gloo ranks badly.
    user_threads = (extra_env or {}).get("OMP_NUM_THREADS", env.get("OMP_NUM_THREADS"))
    run_env["OMP_NUM_THREADS"] = user_threads or str(max(1, (os.cpu_count() or 1) // cfg.parallel.nproc))
    run_env.update(extra_env or {})
    env.update(run_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    check_launchable(cfg)
    if runs_on_other_machines(cfg):
        remote_env = {k: v for k, v in run_env.items() if k != "OMP_NUM_THREADS" or user_threads}
        env["DS_ENV_FILE"] = str(write_remote_env(folder, remote_env, env, cfg.parallel.nproc))
        hosts = list(parse_hostfile(Path(cfg.parallel.hostfile).read_text())[0])
        remote_stop.record(folder.root, hosts, env)  # how a stop reaches them (remote_stop says why)
    cmd = launch_command(cfg, folder)
    folder.logs.mkdir(parents=True, exist_ok=True)
    (folder.logs / "command.txt").write_text(" ".join(cmd) + "\n")
    if die_with_parent:
        cmd = [sys.executable, "-m", "supervisor.guard", *(["--watch-parent"] if from_any_thread else []), *cmd]
    log = open(folder.logs / "launcher.log", "ab")
    log.write(f"{LAUNCH_MARKER}\n".encode())  # what came before is an earlier launch's (supervisor.remote)
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=str(REPO_ROOT), env=env, start_new_session=True)
    log.close()
    (folder.root / "launcher.pid").write_text(str(proc.pid))
    return LaunchedRun(folder, proc)
