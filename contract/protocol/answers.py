"""What each command answers: one pydantic model per command (`Command.returns`), declared here
beside the commands of contract.protocol. Rank 0 builds it (engine.control.pending.Reply.done: a
handler's result that does not fit its declaration is answered as an error, never sent half
right); the wire carries its JSON (`answer.wire()`); the client parses it back
(supervisor.client: `RunClient.status().step`), and everyone reads its fields (an answer is no
mapping: `answer["step"]` fails; tests/test_declared_once.py also fails on such a read in app/ and
supervisor/). Nested parts whose shape belongs to another layer (metrics, the settings, a
source's description, the OpenAI choices) are plain JSON objects."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from contract.protocol.states import RunState

JSON = dict[str, Any]


class Answer(BaseModel):
    """A command's answer: frozen, and every field declared (an undeclared one is refused where
    the answer is built, so a misspelt or forgotten field shows at once)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def wire(self) -> JSON:
        """The JSON form `done` carries."""
        return self.model_dump(mode="json")


class Stepped(Answer):
    step: int = Field(description="The training step the command was answered at.")


# -- generation -----------------------------------------------------------------------------------
class GenerateAnswer(Stepped):
    text: str = Field(description="The answer of the live weights.")
    model: str = Field(default="current", description="Which weights answered: current.")
    seed: int | None = Field(default=None, description="The sampling seed (a fresh one when none was given).")
    base: str | None = Field(default=None, description="With compare_base: the base model's answer.")
    note: str | None = Field(default=None, description="Why there is no base answer, when there is none.")


class CompleteAnswer(Stepped):
    seed: int | None = Field(default=None, description="The sampling seed.")
    model: str = Field(default="current", description="Which weights answered.")
    choices: list[JSON] = Field(description="One per sample: text, finish reason, log-probabilities.")
    batch: Any = Field(default=None, description="How the request was batched with others.")
    usage: JSON = Field(description="prompt_tokens, completion_tokens.")


# -- run state ------------------------------------------------------------------------------------
class StateAnswer(Stepped):
    """pause, resume: the run's state after the command."""
    state: RunState


class StopAnswer(StateAnswer):
    checkpoint: str | None = Field(default=None, description="The checkpoint written now (save=true).")
    final_model: bool = Field(description="Whether the final model will be saved at the end.")
    save_error: str | None = Field(default=None, description="Why the checkpoint could not be written.")


class SaveAnswer(Stepped):
    checkpoint: str = Field(description="The checkpoint folder written.")


class EvaluateAnswer(Stepped):
    metrics: JSON = Field(description="The evaluation's metrics by name.")


class SetAnswer(Stepped):
    changes: JSON = Field(description="Each changed setting's value now.")
    applies_from_step: int = Field(description="The first step trained with the changes.")


class StatusAnswer(Stepped):
    epoch: int
    total_steps: int | None = None
    state: RunState
    paused: bool
    queue: int = Field(description="Commands waiting for the next step boundary.")
    accepting: bool = Field(description="Whether the run takes commands now.")
    last_train: JSON | None = None
    last_eval: JSON | None = None
    settings: JSON = Field(description="The live settings: lr, lr_scale, grad_clip, eval/save every, generation.")
    world_size: int
    sources: list[JSON] = Field(default_factory=list, description="The training sources and their weights.")
    memory_mb: dict[str, JSON] = Field(description="Memory in MiB by rank.")
    memory_of: str = Field(description="Whose memory: rank 0's, or every rank's.")
    serving: JSON = Field(default_factory=dict, description="The serving budget of the OpenAI-compatible API.")
    boundary: JSON = Field(default_factory=dict, description="The step boundary's idle exchanges.")
    control: JSON | None = Field(default=None, description="The control server's connections and limits "
                                 "(answered at once only).")


# -- rewind, branch, snapshot ---------------------------------------------------------------------
class RewindAnswer(Stepped):
    """The `rewind` event's fields: training goes on after `step`."""
    type: str
    target: str
    source: str = Field(description="The checkpoint URL, or snapshot:<name>.")
    from_step: int
    abandoned: list[int] = Field(description="[first, last] steps given up; [] when none.")
    branch: str
    epoch: int
    batch_in_epoch: int
    reason: str = "user"
    seconds: float = 0.0


class BranchAnswer(RewindAnswer):
    parent: str | None = None
    left: str | None = None
    changes: JSON = Field(default_factory=dict)
    set: SetAnswer | None = Field(default=None, description="The branch's settings, applied as a set.")


class SnapshotAnswer(Stepped):
    type: str
    name: str
    branch: str
    bytes: int
    total_bytes: int
    kept: list[str]
    evicted: list[str]
    seconds: float


class BranchesAnswer(Stepped):
    current: str = Field(description="The present branch.")
    tree: Any = Field(description="The branch tree.")
    checkpoints: dict[str, list[str]] = Field(description="Checkpoints one can go back to, by branch.")
    snapshots: list[str]
    snapshot_details: list[JSON]


# -- data -----------------------------------------------------------------------------------------
class SourcesAnswer(Stepped):
    """add_source, set_weight, remove_source, forget: the source changed and all the sources."""
    source: JSON
    sources: list[JSON]
    applies_from_step: int


class AddSourceAnswer(SourcesAnswer):
    report: str = Field(description="How the file was read: rows kept, dropped and why.")
    dropped: int
    dropped_rows: list[str]


class SetWeightAnswer(SourcesAnswer):
    before: float = Field(description="The weight before.")


class ForgetAnswer(SourcesAnswer):
    id: str


class TeachAnswer(Stepped):
    id: str = Field(description="The inbox entry's id.")
    prompt: str
    answer: str
    old: str = Field(description="The model's greedy answer before.")
    per_step: int
    steps: int
    check_at_step: int | None
    rejected: str | None = None
    margin: float | None = Field(default=None, description="A pair's log p(chosen) - log p(rejected) now.")
    applies_from_step: int
    sources: list[JSON]


class InboxAnswer(Stepped):
    entries: list[JSON] = Field(description="{id, prompt, answer, removed, steps_left[, rejected]}")
    sources: list[JSON]
