"""Where the ranks of a run meet: on one machine, on loopback only.

torch's `env://` rendezvous makes rank 0 host a TCPStore on MASTER_PORT that listens on every
address (`::`), whatever MASTER_ADDR says, so anyone who can reach the machine could talk to the
run's store. When MASTER_ADDR is a loopback address (every run on one machine), rank 0 binds the
store's socket itself, to MASTER_ADDR only, and hands it to the TCPStore (`master_listen_fd`);
gloo's own sockets (and NCCL's bootstrap) are put on the loopback interface (GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME = lo, unless already set). Across machines (any other MASTER_ADDR) nothing
changes: the store listens on MASTER_PORT on every address of the first node, and gloo / NCCL on
the interface that reaches the others. Under torchrun (parallel.launcher=torchrun) the launcher's
agent hosts the store itself, on every address: only gloo / NCCL are kept on loopback then.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout


def on_loopback(address: str) -> bool:
    """Whether `address` (an IP or host name) is this machine's loopback."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def join_on_loopback(backend: str) -> bool:
    """Initialise torch.distributed from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT with a
    store that listens on MASTER_ADDR only, when that is loopback; returns whether it did (if
    not, the caller's usual env:// initialisation runs)."""
    address = os.environ["MASTER_ADDR"]
    if dist.is_initialized() or not on_loopback(address) or _agent_hosts_store():
        return False
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    rank, world, port = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"])
    listen_fd = None
    if rank == 0:
        try:
            listen_fd = _listen(address, port)
        except OSError as e:
            # one process alone (a script or a test): a MASTER_PORT inherited from an earlier
            # in-process run may have been taken since; no peer needs to know the new one
            if e.errno != errno.EADDRINUSE or world != 1:
                raise
            port = free_port(address)
            os.environ["MASTER_PORT"] = str(port)
            listen_fd = _listen(address, port)
    store = dist.TCPStore(address, port, world, rank == 0, default_pg_timeout,
                          master_listen_fd=listen_fd, multi_tenant=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=default_pg_timeout)
    return True


def _agent_hosts_store() -> bool:
    """Under torchrun the launcher's agent already hosts the store on MASTER_PORT (on every
    address; its workers are only clients of it)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def free_port(address: str = "127.0.0.1") -> int:
    """A port free on `address` now (the store binds it right after)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _listen(address: str, port: int) -> int:
    """A socket listening on `address`:`port` only; the store owns its descriptor from now on."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(1024)
    return sock.detach()
