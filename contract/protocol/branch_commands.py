"""The commands that move a run within its branch tree: rewind, branch, snapshot and the
tree itself. Import them through contract.protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from contract.protocol.roles import Role
from contract.protocol.base import Command, ProtocolError, _arg


def _check_target(label: str, target: str) -> None:
    if not target.strip():
        raise ProtocolError(f"{label}: argument 'target' must name a checkpoint (step-40), a step "
                            "number (40) or a snapshot")


@dataclass(frozen=True)
class Rewind(Command):
    """Go back, in place, to a checkpoint or snapshot of this run: every rank loads it into the
    running engines (model, optimizer, scheduler, data position, RNGs, live settings) and
    training goes on from there on the same branch; the steps after it are abandoned."""
    name: ClassVar[str] = "rewind"
    target: str = _arg("", "The checkpoint (step-40, or 40: that step's checkpoint of the present "
                       "branch, else of an ancestor) or a snapshot's name.")

    def _check(self) -> None:
        _check_target(self.label, self.target)


@dataclass(frozen=True)
class Branch(Command):
    """Rewind to `target` and go on as a new branch `name` (the present branch stays as it is and
    can be branched from later), optionally with changed settings."""
    name: ClassVar[str] = "branch"
    target: str = _arg("", "The checkpoint or snapshot the branch starts from (as rewind's).")
    branch: str = _arg("", "The new branch's name (letters, digits, - _ .; unique in the run).")
    lr: float | None = _arg(None, "Learning rate of the branch's first step (as set).", minimum=0.0, maximum=10.0)
    lr_scale: float | None = _arg(None, "Factor on the configured schedule (as set).",
                                  minimum=0.0, maximum=1e6, exclusive_minimum=True)
    grad_clip: float | None = _arg(None, "Gradient clipping norm; 0: off.", minimum=0.0, maximum=1e9)
    eval_every_n_steps: int | None = _arg(None, "Evaluate every n steps; 0: off.", minimum=0, maximum=2**31)
    save_every_n_steps: int | None = _arg(None, "Checkpoint every n steps; 0: off.", minimum=0, maximum=2**31)

    def _check(self) -> None:
        _check_target(self.label, self.target)
        from contract.branches import check_name  # the one rule for names (torch-free, ours)
        try:
            check_name(self.branch, "branch")
        except ValueError as e:
            raise ProtocolError(f"branch: {e}") from None

    def settings(self) -> dict[str, Any]:
        """The settings the branch changes, as `set` arguments."""
        return {k: v for k, v in self.given().items() if k not in ("target", "branch")}


@dataclass(frozen=True)
class Snapshot(Command):
    """Keep the complete training state in host memory now, for an instant rewind (bounded by
    checkpoint.snapshots_keep / snapshots_max_mib; the oldest goes first)."""
    name: ClassVar[str] = "snapshot"
    # `snapshot`, not `name`: `name` is every command's wire name
    snapshot: str | None = _arg(None, "The snapshot's name (unique among those kept); default snap-<step>.")

    def _check(self) -> None:
        if self.snapshot is not None:
            from contract.branches import check_name
            try:
                check_name(self.snapshot, "snapshot")
            except ValueError as e:
                raise ProtocolError(f"snapshot: {e}") from None


@dataclass(frozen=True)
class Branches(Command):
    """The run's branch tree, the present branch, its checkpoints and the snapshots in memory."""
    name: ClassVar[str] = "branches"
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
