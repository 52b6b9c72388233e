"""What a run folder says of how the ranks seen gone ended, for `judgement.judge`: the launcher's
report (its exit status and the pid it saw fail first) and the last exception in each gone rank's
log, and which of those name a lost peer (a rank that died because another did). Read only once
a rank is gone: a few log tails. Torch-free."""

from __future__ import annotations

from typing import Any

from contract.run_folder import RunFolder
from supervisor.judgement import LOST_PEER, RankExit, last_exception
from supervisor.records import launcher_reported_failure, log_tail


def exit_evidence(folder: RunFolder, exits: tuple[RankExit, ...], log_lines: int) -> dict[str, Any]:
    """`judgement.Facts`' fields on how the ranks in `exits` ended (none when no rank is gone):
    launcher_status, launcher_pid, raised (ranks whose log ends in an exception), lost_peer
    (those whose exception names a lost peer)."""
    if not exits:
        return {}
    status, pid = launcher_reported_failure(folder)
    raised, lost = set(), set()
    for rank in {e.rank for e in exits}:
        error = last_exception(log_tail(folder, rank, log_lines)[1])
        if error is not None:
            raised.add(rank)
            if LOST_PEER.search(error):
                lost.add(rank)
    return dict(launcher_status=status, launcher_pid=pid, raised=frozenset(raised), lost_peer=frozenset(lost))
