"""A one-node Slurm cluster on this machine, for the Slurm tests: Debian's munge and slurm-wlm,
with a munge key, a slurm.conf (one node, 2 CPUs, the machine's own name on 127.0.0.1) and
state folders of the test's own in a temporary folder; slurmctld and slurmd run in the
foreground as children of the test and are ended with everything they started. Clients
(sbatch, scontrol, scancel, srun in the job) find the cluster through SLURM_CONF.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

TOOLS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch")
CTLD_PORT, SLURMD_PORT = 16817, 16818  # unusual ports, on loopback


class SlurmUnavailable(RuntimeError):
    """The daemons cannot run here: the reason (the daemon's own words)."""


def check_available() -> None:
    if os.geteuid() != 0:
        raise SlurmUnavailable("needs root (slurmd runs jobs as their user)")
    for tool in TOOLS:
        if not os.path.exists(tool):
            raise SlurmUnavailable(f"{tool} is missing (apt-get install slurm-wlm munge; .ci/setup-hosts.sh)")


def _conf(d: Path, node: str) -> str:
    return f"""ClusterName=livetune
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
KillWait=10
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def slurm_cluster(d: Path) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and slurmd; yields the environment clients need (SLURM_CONF).
    Everything is ended on exit, whatever happened."""
    check_available()
    d.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (d / sub).mkdir(exist_ok=True)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    node = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text(_conf(d, node))
    env = {"SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen] = []
    try:
        subprocess.run(["/usr/sbin/munged", f"--key-file={key}", f"--socket={d}/munge.socket",
                        f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                        f"--seed-file={d}/munged.seed", "--force"], check=True, capture_output=True, timeout=30)
        full = {**os.environ, **env}
        for argv in (["/usr/sbin/slurmctld", "-D", "-i", "-f", str(conf)],
                     ["/usr/sbin/slurmd", "-D", "-f", str(conf), "-N", node]):
            daemons.append(subprocess.Popen(argv, env=full, stdout=open(d / f"{Path(argv[0]).name}.out", "ab"),
                                            stderr=subprocess.STDOUT, start_new_session=True))
            time.sleep(1.0)
        _wait_idle(d, full, daemons)
        yield env
    finally:
        for proc in reversed(daemons):  # slurmd first: it ends its job steps
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((d / "munged.pid").read_text()), signal.SIGTERM)


def _wait_idle(d: Path, env: dict[str, str], daemons: list[subprocess.Popen], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in daemons:
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{proc.args[0]} exited: " + _tail(d / f"{Path(proc.args[0]).name}.out")
                                       + _tail(d / f"{Path(proc.args[0]).name}.log"))
        got = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=env, timeout=30)
        if got.returncode == 0 and got.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    raise SlurmUnavailable("the node did not become idle: " + _tail(d / "slurmd.log") + _tail(d / "slurmctld.log"))


def _tail(path: Path, n: int = 800) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
