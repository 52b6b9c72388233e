"""Helpers for tests that start a small multi-rank DeepSpeed script. Not a test module.

    proc = run_deepspeed(SCRIPTS / "my_check.py", nproc=2, args=("--stage", "3"))
    results = parse_results(proc)          # the {"rank": ..} dicts the ranks printed

The script runs under the real DeepSpeed launcher (what `deepspeed --num_gpus N` starts, gloo on
CPU; one rank is started with the launcher's environment, without it); it must accept the
`--local_rank=N` argument the launcher appends, and can report to the test by printing
`RESULT {json}` lines (see :func:`report`). The launcher and its ranks get their own process
group, so a timeout kills all of them and leaves no orphan.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from supervisor.launch import local_launch_command

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TAG = "RESULT"


class DistScriptError(AssertionError):
    """A multi-rank script failed or timed out; the message ends with the tail of its output."""


def default_precision() -> str:
    """What `precision: auto` gives on this machine: bf16 where the hardware does it natively
    (a CPU with AVX512-BF16 or AMX), else fp32 (an AVX2-only CPU emulates bf16 at a tenth of fp32's
    speed). The tests at "the precision a user gets by default" expect this, not a fixed bf16."""
    from engine.parallel.ds_config import resolve_precision
    return resolve_precision("auto")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_command(script_path: str | Path, nproc: int = 2, args: Sequence[str] = ()) -> list[str]:
    """The launcher command line, on a free rendezvous port (other tests may run at the same
    time, and DeepSpeed's default port would clash): DeepSpeed's per-machine launcher started
    directly, as the supervisor starts a one-machine run (supervisor.launch.local_launch_command:
    what `deepspeed --num_gpus N` runs, without the runner in front of it)."""
    return local_launch_command(nproc, free_port(), [str(script_path), *map(str, args)])


def one_rank_command(script_path: str | Path, args: Sequence[str] = ()) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of a one-rank run as DeepSpeed's launcher would start its one rank:
    the same variables and `--local_rank=0`, without the launcher process in between (it only
    imports deepspeed, ~2 s of CPU, to start this one process)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1", "RANK": "0",
           "LOCAL_RANK": "0", "LOCAL_SIZE": "1", "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    return [sys.executable, "-u", str(script_path), "--local_rank=0", *map(str, args)], env


def run_deepspeed(script_path: str | Path, nproc: int = 2, args: Sequence[str] = (), timeout: float = 300,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `script_path` on `nproc` ranks and return the finished process (stdout and stderr
    merged into `.stdout`); raise DistScriptError with the output's tail when it fails or
    runs past `timeout` seconds."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": "1",  # two ranks share few cores; more threads only contend
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                **(env or {})}
    if nproc == 1:
        cmd, rank_env = one_rank_command(script_path, args)
        full_env.update(rank_env)
    else:
        cmd = deepspeed_command(script_path, nproc, args)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        raise DistScriptError(f"{Path(script_path).name} ran past {timeout:.0f} s\n{tail(out)}") from None
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    if proc.returncode != 0:
        raise DistScriptError(f"{Path(script_path).name} exited with {proc.returncode}\n{tail(out)}")
    return done


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started: launcher and its ranks
    except ProcessLookupError:
        pass


def tail(text: str | None, lines: int = 60) -> str:
    return "\n".join((text or "").splitlines()[-lines:])


def report(**values) -> None:
    """Call from inside a rank: print one result line the test reads with :func:`parse_results`.

    One os.write of the whole line: the ranks share the launcher's stdout, and a write of up to
    PIPE_BUF (4 KiB) bytes is never interleaved with another rank's, unlike print's pieces.
    """
    line = f"{TAG} {json.dumps(values)}\n".encode()
    if len(line) > 4096:
        raise ValueError(f"a result line must stay under 4 KiB to arrive whole, got {len(line)} bytes")
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line)


def parse_results(proc: subprocess.CompletedProcess, tag: str = TAG) -> list[dict]:
    """Every `RESULT {json}` line of the run's output, in order."""
    results = []
    for line in proc.stdout.splitlines():
        _, sep, rest = line.partition(f"{tag} ")
        if sep and rest.startswith("{"):
            results.append(json.loads(rest))
    return results
