"""Two hosts on this one machine, for the tests of several machines.

Each host is a network namespace (its own interfaces, addresses and ports) with its own host
name (a UTS namespace), joined to the other by a veth pair on a private /24 that exists only
inside these namespaces. Each runs Debian's OpenSSH server with host keys, an authorized key
and a config of the test's own (nothing under ~/.ssh or /etc/ssh is touched); the ssh client the
launcher and pdsh run is a wrapper that reads the test's own ssh_config (`Host.env`). The file
system is shared by both, as a cluster's shared file system would be: the same repository,
virtual environment and run folder paths on every host.

Everything is torn down on exit, failure included: the sshd processes, the namespaces (the
veth goes with them), the key folder and the /etc/hosts lines. Traffic stays on these two
addresses and loopback: nothing is routed out of the namespaces.

    with two_hosts(tmp_path) as hosts:
        a, b = hosts.hosts
        with in_host(b):      # this thread's sockets and children live on host b
            ...
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

SUBNET = "10.231.7"      # private, used only inside the namespaces
TAG = "livetune-two-hosts"  # marks our /etc/hosts lines
SSHD = "/usr/sbin/sshd"
CLONE_NEWNET, CLONE_NEWUTS = 0x40000000, 0x04000000
_libc = ctypes.CDLL(None, use_errno=True)


class HostsUnavailable(RuntimeError):
    """This machine cannot make the hosts (no root, no sshd, no pdsh): the reason."""


@dataclass
class Host:
    name: str          # host name (resolves through /etc/hosts to `address`)
    netns: str         # `ip netns` name
    address: str
    sshd: subprocess.Popen | None = None

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"


@dataclass
class TwoHosts:
    hosts: list[Host]
    folder: Path                       # keys, configs, the ssh wrapper
    env: dict[str, str] = field(default_factory=dict)  # for the launcher: PATH with our ssh first

    def hostfile(self, path: Path, slots: int = 1) -> Path:
        """A DeepSpeed hostfile naming both hosts, `slots` processes each."""
        path.write_text("".join(f"{h.name} slots={slots}\n" for h in self.hosts))
        return path

    def processes(self, host: Host) -> list[int]:
        """Pids of every process living in `host`'s network namespace, its sshd excluded."""
        target = os.stat(host.netns_path).st_ino
        keep = {host.sshd.pid} if host.sshd else set()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in keep:
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == target and not _zombie(int(entry)):
                    found.append(int(entry))
            except OSError:
                continue
        return found


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _setns(path: str, kind: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, kind) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_host(host: Host) -> Iterator[None]:
    """Run the body on `host`: this thread's new sockets and child processes belong to its
    network namespace (setns changes only the calling thread). Restored on exit."""
    own = f"/proc/self/task/{_gettid()}/ns/net"
    back = os.open(own, os.O_RDONLY)
    try:
        _setns(host.netns_path, CLONE_NEWNET)
        yield
    finally:
        if _libc.setns(back, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "could not return to this thread's own network namespace")
        os.close(back)


def _gettid() -> int:
    return ctypes.CDLL(None).syscall(186)  # SYS_gettid on x86_64


def check_available() -> None:
    """Raise HostsUnavailable with the reason when this machine cannot make the two hosts."""
    if os.geteuid() != 0:
        raise HostsUnavailable("needs root (network namespaces, /etc/hosts)")
    for tool in (SSHD, "/usr/bin/ssh", "/usr/bin/ssh-keygen", "/usr/bin/pdsh", "/usr/bin/unshare"):
        if not os.path.exists(tool):
            raise HostsUnavailable(f"{tool} is missing (apt-get install openssh-server pdsh; .ci/setup-hosts.sh)")
    if shutil.which("ip") is None:
        raise HostsUnavailable("the ip command (iproute2) is missing")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_hosts(folder: Path, prefix: str = "lt") -> Iterator[TwoHosts]:
    """Two hosts `<prefix>-node-a` (SUBNET.1) and `<prefix>-node-b` (SUBNET.2), each with sshd
    on port 22 of its own address; torn down on exit, whatever happened."""
    check_available()
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    suffix = f"{os.getpid()}"
    hosts = [Host(f"{prefix}-node-{c}", f"{prefix}{suffix}{c}", f"{SUBNET}.{i + 1}")
             for i, c in enumerate("ab")]
    net = TwoHosts(hosts, folder)
    try:
        _make_network(hosts, suffix)
        _add_host_names(hosts)
        _make_ssh(net)
        yield net
    finally:
        _tear_down(net)


def _make_network(hosts: list[Host], suffix: str) -> None:
    a, b = hosts
    va, vb = f"lt{suffix}a"[-15:], f"lt{suffix}b"[-15:]
    for h in hosts:
        _run("ip", "netns", "add", h.netns)
    _run("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
    for h, dev in ((a, va), (b, vb)):
        _run("ip", "link", "set", dev, "netns", h.netns)
        _run("ip", "-n", h.netns, "link", "set", dev, "name", "eth0")  # as on a real host
        _run("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
        _run("ip", "-n", h.netns, "link", "set", "eth0", "up")
        _run("ip", "-n", h.netns, "link", "set", "lo", "up")


def _add_host_names(hosts: list[Host]) -> None:
    lines = "".join(f"{h.address} {h.name}  # {TAG}\n" for h in hosts)
    with open("/etc/hosts", "a") as f:  # appended in place: /etc/hosts may be a bind mount
        f.write(lines)


def _remove_host_names(hosts: list[Host]) -> None:
    ours = {f"{h.address} {h.name}  # {TAG}" for h in hosts}
    with open("/etc/hosts", "r+") as f:
        kept = [line for line in f.read().splitlines(keepends=True) if line.rstrip("\n") not in ours]
        f.seek(0)
        f.write("".join(kept))
        f.truncate()


def _make_ssh(net: TwoHosts) -> None:
    d = net.folder
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "livetune-test", "-f", str(d / "id_ed25519"))
    (d / "authorized_keys").write_text((d / "id_ed25519.pub").read_text())
    known = []
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation folder
    for h in net.hosts:
        key = d / f"host_key_{h.name}"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
        known.append(f"{h.name},{h.address} {Path(str(key) + '.pub').read_text().strip()}\n")
        config = d / f"sshd_config_{h.name}"
        config.write_text(
            f"Port 22\nListenAddress {h.address}\nHostKey {key}\nAuthorizedKeysFile {d}/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            f"UsePAM no\nStrictModes no\nPidFile {d}/sshd_{h.name}.pid\nLogLevel ERROR\n")
        # its own host name (UTS namespace): what the ranks' gloo resolves to its address
        h.sshd = subprocess.Popen(
            ["ip", "netns", "exec", h.netns, "unshare", "--uts", "sh", "-c",
             f"hostname {h.name} && exec {SSHD} -D -e -f {config}"],
            stdout=open(d / f"sshd_{h.name}.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    (d / "known_hosts").write_text("".join(known))
    names = " ".join(h.name for h in net.hosts)
    (d / "ssh_config").write_text(
        f"Host {names}\n  User root\n  IdentityFile {d}/id_ed25519\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {d}/known_hosts\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
        "  ConnectTimeout 10\n")
    bin_dir = d / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f"#!/bin/sh\nexec /usr/bin/ssh -F {d}/ssh_config \"$@\"\n")
    wrapper.chmod(0o755)
    net.env = {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    _wait_for_ssh(net)


def _wait_for_ssh(net: TwoHosts, timeout: float = 60.0) -> None:
    """Until both hosts answer `ssh HOST hostname` with their own name (from host a)."""
    deadline = time.monotonic() + timeout
    for h in net.hosts:
        while True:
            cmd = ["ip", "netns", "exec", net.hosts[0].netns, str(net.folder / "bin" / "ssh"), h.name, "hostname"]
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if got.returncode == 0 and got.stdout.strip() == h.name:
                break
            if time.monotonic() > deadline:
                log = (net.folder / f"sshd_{h.name}.log").read_text(errors="replace")
                raise HostsUnavailable(f"ssh to {h.name} failed: {got.stderr.strip()} / sshd: {log[-500:]}")
            time.sleep(0.5)


def _tear_down(net: TwoHosts) -> None:
    """End every process left in the namespaces (sshd and its sessions too), then delete them,
    the /etc/hosts lines and the key folder. Each part is attempted even if another fails."""
    for h in net.hosts:
        with contextlib.suppress(OSError):
            if os.path.exists(h.netns_path):
                for pid in net.processes(h) + ([h.sshd.pid] if h.sshd else []):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
        if h.sshd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.sshd.wait(timeout=10)
    for h in net.hosts:
        subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, timeout=30)
    with contextlib.suppress(OSError):
        _remove_host_names(net.hosts)
    shutil.rmtree(net.folder, ignore_errors=True)
