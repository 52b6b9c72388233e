"""The commands that move a run within its branch tree: rewind, branch, snapshot and the
tree itself. Import them through contract.protocol."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Field

from contract.protocol.answers import Answer, BranchAnswer, BranchesAnswer, RewindAnswer, SnapshotAnswer
from contract.protocol.roles import Role
from contract.branches import check_name
from contract.protocol.base import Command


def _target(target: str) -> str:
    if not target.strip():
        raise ValueError("argument 'target' must name a checkpoint (step-40), a step number (40) or a snapshot")
    return target


Target = Annotated[str, AfterValidator(_target)]
# the one rule for names (contract.branches)
BranchName = Annotated[str, AfterValidator(lambda name: check_name(name, "branch"))]
SnapshotName = Annotated[str, AfterValidator(lambda name: check_name(name, "snapshot"))]


class Rewind(Command):
    """Go back, in place, to a checkpoint or snapshot of this run: every rank loads it into the
    running engines (model, optimizer, scheduler, data position, RNGs, live settings) and
    training goes on from there on the same branch; the steps after it are abandoned."""
    name: ClassVar[str] = "rewind"
    returns: ClassVar[type[Answer]] = RewindAnswer
    target: Target = Field(description="The checkpoint (step-40, or 40: that step's checkpoint of the "
                           "present branch, else of an ancestor) or a snapshot's name.")


class Branch(Command):
    """Rewind to `target` and go on as a new branch `name` (the present branch stays as it is and
    can be branched from later), optionally with changed settings."""
    name: ClassVar[str] = "branch"
    returns: ClassVar[type[Answer]] = BranchAnswer
    target: Target = Field(description="The checkpoint or snapshot the branch starts from (as rewind's).")
    branch: BranchName = Field(description="The new branch's name (letters, digits, - _ .; unique in the run).")
    lr: float | None = Field(default=None, ge=0.0, le=10.0, description="Learning rate of the branch's first "
                             "step (as set).")
    lr_scale: float | None = Field(default=None, gt=0.0, le=1e6, description="Factor on the configured schedule "
                                   "(as set).")
    grad_clip: float | None = Field(default=None, ge=0.0, le=1e9, description="Gradient clipping norm; 0: off.")
    eval_every_n_steps: int | None = Field(default=None, ge=0, le=2**31, description="Evaluate every n steps; 0: off.")
    save_every_n_steps: int | None = Field(default=None, ge=0, le=2**31, description="Checkpoint every n steps; "
                                           "0: off.")

    def settings(self) -> dict[str, Any]:
        """The settings the branch changes, as `set` arguments."""
        return self.model_dump(exclude={"target", "branch"}, exclude_none=True)


class Snapshot(Command):
    """Keep the complete training state in host memory now, for an instant rewind (bounded by
    checkpoint.snapshots_keep / snapshots_max_mib; the oldest goes first)."""
    name: ClassVar[str] = "snapshot"
    returns: ClassVar[type[Answer]] = SnapshotAnswer
    # `snapshot`, not `name`: `name` is every command's wire name
    snapshot: SnapshotName | None = Field(default=None, description="The snapshot's name (unique among those kept); "
                                          "default snap-<step>.")


class Branches(Command):
    """The run's branch tree, the present branch, its checkpoints and the snapshots in memory."""
    name: ClassVar[str] = "branches"
    returns: ClassVar[type[Answer]] = BranchesAnswer
    role: ClassVar[Role] = Role.VIEWER  # reads or answers; changes nothing
