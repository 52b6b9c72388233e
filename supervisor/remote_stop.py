"""Ending a run that DeepSpeed started on other machines, and nothing else there.

DeepSpeed's multi-node runner answers SIGTERM or SIGINT by running, through pdsh on every host,
`pkill -f "<python> -u -m deepspeed.launcher.launch"` (deepspeed/launcher/runner.py and
multinode_runner.py): a pattern that names no run, so it ends every DeepSpeed launch of that
Python on those machines -- another user's run, another run of ours, a test in the neighbouring
worker (this is how it was found: two-host tests killed other tests' runs on the same machine).
So the runner of such a run must never get SIGTERM from us. Instead:

1. its processes on every machine are ended by a pattern only this run matches: its run folder
   in the command line (`engine.worker --run-dir FOLDER`, which the remote launcher's and shell's
   command lines carry too), SIGTERM first, SIGKILL after a grace;
2. the group here (the runner, pdsh and its ssh clients: no state of their own) gets SIGKILL,
   which runs no handler.

The machines are reached the way the launcher reached them: pdsh over ssh, with the PATH and
pdsh settings the run was launched with, which `record` keeps in the run folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

RECORD = "remote_hosts.json"  # in the run folder; only runs on other machines have one
_ERE_SPECIAL = re.compile(r"([.\[\]{}()\\*+?^$|])")
ENV_KEYS = ("PATH", "PDSH_RCMD_TYPE", "PDSH_SSH_ARGS", "PDSH_SSH_ARGS_APPEND", "HOME")


def record(root: Path, hosts: list[str], env: dict[str, str]) -> None:
    """Remember, in the run folder, the machines a run was started on and how they were reached."""
    kept = {k: env[k] for k in ENV_KEYS if k in env}
    kept.setdefault("PDSH_RCMD_TYPE", "ssh")  # what DeepSpeed's runner sets for its own pdsh
    (root / RECORD).write_text(json.dumps({"hosts": hosts, "env": kept}))


def recorded(root: Path) -> tuple[list[str], dict[str, str]]:
    """(hosts, environment) of a run started on other machines; ([], {}) for any other run."""
    try:
        data = json.loads((root / RECORD).read_text())
    except (OSError, ValueError):
        return [], {}
    hosts = [h for h in data.get("hosts", []) if isinstance(h, str) and h]
    env = {k: v for k, v in data.get("env", {}).items() if isinstance(k, str) and isinstance(v, str)}
    return hosts, env


def run_pattern(root: Path) -> str:
    """A `pkill -f` pattern (POSIX extended regex) for this run's processes on a machine and no
    other run's: DeepSpeed's per-machine launcher (`-m deepspeed.launcher.launch ... --run-dir
    FOLDER`, and the remote shell that started it) and the ranks (`-m engine.worker --local_rank=N
    --run-dir FOLDER`), FOLDER followed by a space or the end. Not the runner on the launching
    machine (`-m deepspeed.launcher.runner ... --module engine.worker --run-dir FOLDER`) nor
    supervisor.guard: a SIGTERM there would start DeepSpeed's pkill of every launch. (The shell
    that runs the pkill carries the pattern in its own command line, escaped: it does not match.)"""
    folder = _ERE_SPECIAL.sub(r"\\\1", str(root))
    return rf"-m (deepspeed\.launcher\.launch .*|engine\.worker .*)--run-dir {folder}( |$)"


def _on_hosts(hosts: list[str], env: dict[str, str], command: str, timeout: float) -> str | None:
    """Run `command` through pdsh on every host, as the launcher reached them; its output, or
    None when pdsh could not be run."""
    try:
        return subprocess.run(["pdsh", "-S", "-w", ",".join(hosts), command], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=timeout, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def signal_remote(root: Path, signal_name: str, timeout: float = 30.0) -> bool:
    """Send `signal_name` (TERM, KILL) to this run's processes on every machine it runs on;
    False when there are none recorded or pdsh could not be run. (pkill's exit code 1, nothing
    matched, is fine: the run is gone there.)"""
    hosts, env = recorded(root)
    command = f"pkill -{signal_name} -f -- {shlex.quote(run_pattern(root))}"
    return bool(hosts) and _on_hosts(hosts, env, command, timeout) is not None


def remote_alive(root: Path, timeout: float = 30.0) -> bool:
    """Whether any machine still runs a process of this run (pgrep over pdsh)."""
    hosts, env = recorded(root)
    command = f"pgrep -f -- {shlex.quote(run_pattern(root))} >/dev/null && echo alive"
    return bool(hosts) and "alive" in (_on_hosts(hosts, env, command, timeout) or "")


def end(root: Path, grace_s: float) -> None:
    """End this run's processes on every machine it was started on: SIGTERM, then SIGKILL what is
    left after `grace_s` (looked for once a second)."""
    if not signal_remote(root, "TERM"):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and remote_alive(root):
        time.sleep(1.0)
    signal_remote(root, "KILL")
