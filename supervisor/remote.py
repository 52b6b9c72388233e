"""Ranks on other machines, as DeepSpeed's multi-node launcher reports them in launcher.log.

With a hostfile naming other machines, every machine's ranks are started by pdsh over ssh: no
rank is a process of the run's group here, so `/proc` cannot say that one died. What can: each
machine runs DeepSpeed's `deepspeed.launcher.launch`, which polls its ranks every second, logs
their pids when it starts them and the return code of the first one that fails, then ends the
others; pdsh relays every line prefixed with the machine's name (`node-b: ...`) into the
launching machine's launcher.log, and adds its own line when a machine's ssh session ends
(`pdsh@here: node-b: ssh exited with exit code 247`).

`RemoteLog` follows launcher.log and turns those lines into `RemoteExit`s: which rank, on which
machine, with which wait status. Only the latest launch counts (a resumed or restarted run
appends to the same log): `supervisor.launch.spawn` writes `LAUNCH_MARKER` before each launcher
starts, so a relaunch is told apart at once, not only once its runner logs its command seconds
later (until then the previous launch's dead rank would be taken for one of the new launch).
A failing machine with several ranks is named, but not which of its ranks failed: DeepSpeed's
launcher logs the return code without the process (its message repeats the last command it
started), so the exit is kept with `rank=None`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

_HOST_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+): (?P<text>.*)$")
_PDSH_LINE = re.compile(r"^pdsh@[^:]*: (?P<host>[A-Za-z0-9_.\-]+): ssh exited with exit code (?P<code>-?\d+)")
_NEW_LAUNCH = re.compile(r"\[runner\.py:\d+:main\] cmd = ")
LAUNCH_MARKER = "=== livetune: a launch of this run begins ==="  # spawn's line (no host prefix)
_MAPPING = re.compile(r"global_rank_mapping=defaultdict\(<class 'list'>, (?P<map>\{.*\})\)")
_SPAWNED = re.compile(r"process (?P<pid>\d+) spawned with command: .*'--local_rank=(?P<local>\d+)'")
_FAILED = re.compile(r"exits with return code = (?P<code>-?\d+)")


@dataclass(frozen=True)
class RemoteExit:
    """A rank (or, with several ranks on the machine, one of them: rank None) that ended badly."""
    host: str
    rank: int | None
    pid: int | None
    status: int      # a wait status, as os.waitpid gives it (signal number, or code << 8)
    how: str         # what the log said, for the report


def wait_status(returncode: int) -> int:
    """A launcher's return code (negative: killed by that signal) as a wait status."""
    return -returncode if returncode < 0 else (returncode & 0xFF) << 8


class RemoteLog:
    """Follows one run's launcher.log (call `poll` as often as wanted: it reads only new lines)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offset = 0
        self._reset()

    def _reset(self) -> None:
        self.ranks: dict[str, list[int]] = {}       # host -> global ranks, from any machine's launcher
        self._pids: dict[tuple[str, int], int] = {}  # (host, local rank) -> pid
        self.exits: dict[str, RemoteExit] = {}       # host -> its first failure

    @property
    def multi_host(self) -> bool:
        """Whether the run's ranks were started on more than one machine."""
        return len(self.ranks) > 1

    def poll(self) -> list[RemoteExit]:
        """Read what was appended since the last call; returns every failure known so far."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return list(self.exits.values())
        end = chunk.rfind(b"\n") + 1  # a partly written last line waits for the next poll
        self._offset += end
        for line in chunk[:end].decode("utf-8", "replace").splitlines():
            self._read_line(line.rstrip())
        return list(self.exits.values())

    def _read_line(self, line: str) -> None:
        if line == LAUNCH_MARKER or _NEW_LAUNCH.search(line) and not _HOST_LINE.match(line):
            self._reset()  # the runner's own line: a new launch of this run begins
            return
        pdsh = _PDSH_LINE.match(line)
        if pdsh:
            code = int(pdsh["code"])
            if code != 0 and pdsh["host"] not in self.exits:  # the machine's launcher itself ended
                self._record(pdsh["host"], None, code, f"ssh session ended with exit code {code}")
            return
        m = _HOST_LINE.match(line)
        if m is None:
            return
        host, text = m["host"], m["text"]
        if (mapping := _MAPPING.search(text)) is not None:
            try:
                self.ranks.update({str(h): list(r) for h, r in ast.literal_eval(mapping["map"]).items()})
            except (ValueError, SyntaxError):
                pass
        elif (spawned := _SPAWNED.search(text)) is not None:
            self._pids[(host, int(spawned["local"]))] = int(spawned["pid"])
        elif (failed := _FAILED.search(text)) is not None and host not in self.exits:
            code = int(failed["code"])
            self._record(host, self._local_rank(host), code, f"return code {code}")

    def _local_rank(self, host: str) -> int | None:
        """The failing rank's local index when the machine ran exactly one rank."""
        return 0 if len(self.ranks.get(host, [])) == 1 else None

    def _record(self, host: str, local: int | None, code: int, how: str) -> None:
        if local is None:
            local = self._local_rank(host)
        rank = self.ranks[host][local] if local is not None else None
        pid = self._pids.get((host, local)) if local is not None else None
        self.exits[host] = RemoteExit(host, rank, pid, wait_status(code), how)
