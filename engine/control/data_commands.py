"""The data commands, run at a step boundary by every rank in the same order.

add_source / set_weight / remove_source change the run's mixture (engine.data.mixture); teach
appends a (prompt as the model saw it, answer) pair to the run's inbox (contract.inbox, written
by rank 0 and fsynced before the answer) and schedules it into the next batches; inbox lists it,
forget stops its use. Each change is checked before anything changes, refused alike on every
rank (CommandRefused), recorded as a `data` / `teach` event and -- being part of the mixture's
state -- in the next checkpoint, so a resume replays it exactly.

A preference (a teach with `rejected`) is taken by every run that can train it: a preference
run with its objective (kto: the two answers judged apart), an SFT run with the pair loss of
`preference.sft_pairs` added to its SFT loss (engine.objectives.preference_step.SftStep); an answer alone
only by an SFT run.

A file is read by every rank; the ranks then compare what they read (sample count) and refuse
together when they differ (a file written to while being added). After `teach.check_after`
steps the boundary asks the prompt again, greedily, and records old and new answers in a
`teach_check` event (`at_boundary`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from contract import inbox as inbox_file
from contract.events import DataEvent, TeachCheckEvent, TeachEvent
from contract.protocol.data_commands import AddSource, Forget, Inbox, RemoveSource, SetWeight, Teach
from engine.control.pending import Reply
from engine.control.run import Plane
from engine.data import build_dataset
from engine.data.inbox import InboxDataset, encode_pair, pairs_as_for
from engine.data.mixture import Mixture, Source
from contract.data_rows import DataError
from engine.generation.generate import generate as generate_text
from engine.objectives.preference import rows_problem
from engine.objectives.preference_step import pairs_problem
from engine.generation.scoring import score

INBOX_SOURCE = "inbox"


class DataRefused(RuntimeError):
    """Raised as the control plane's CommandRefused (handlers.py registers these handlers)."""


def mixture_of(control: Plane, label: str) -> Mixture:
    mixture = getattr(control.trainer.train_dataset, "mixture", None)
    if mixture is None:
        raise DataRefused(f"{label}: this run trains on a dataset given in code, not on sources")
    return mixture


def _agree(control: Plane, value: Any) -> list[Any]:
    """Every rank's `value` (collective when there are several ranks)."""
    if control.world_size == 1:
        return [value]
    everyone: list[Any] = [None] * control.world_size
    dist.all_gather_object(everyone, value)
    return everyone


def _from_rank0(control: Plane, value: Any) -> Any:
    if control.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _changed(control: Plane, mixture: Mixture, change: str, source: dict, **extra: Any) -> dict:
    """Record a data change (a `data` event) and the reply to its sender."""
    step = control.trainer.state.global_step
    sources = mixture.describe()
    control.trainer.emit(DataEvent(step=step, change=change, source=source, sources=sources,
                                   applies_from_step=step + 1, **extra))
    return {"step": step, "source": source, "sources": sources, "applies_from_step": step + 1, **extra}


# -- sources ------------------------------------------------------------------------------------
def add_source(control: Plane, cmd: AddSource, reply: Reply) -> dict:
    trainer = control.trainer
    mixture = mixture_of(control, "add_source")
    path = str(Path(cmd.path).expanduser().resolve()) if "://" not in cmd.path else cmd.path
    name = cmd.source or Path(path).stem
    if any(s.name == name for s in mixture.live()):
        raise DataRefused(f"add_source: a source named {name!r} exists already; give `source` another name")
    data = trainer.config.data
    try:
        dataset, report = build_dataset(path, trainer.tokenizer, format=cmd.format,
                                        max_length=data.max_length, overlong=data.overlong)
        outcome: Any = len(dataset)
    except (DataError, OSError) as e:
        dataset, report, outcome = None, None, f"add_source: {e}"
    outcomes = _agree(control, outcome)
    refusals = [o for o in outcomes if isinstance(o, str)]
    if refusals:
        raise DataRefused(refusals[0] + "; the run goes on unchanged")
    if len(set(outcomes)) > 1:
        raise DataRefused(f"add_source: the ranks read different numbers of samples from {path} "
                          f"({outcomes}); is it being written? The run goes on unchanged")
    problem = rows_problem(trainer.config, report.format, path)  # one kind of sample per batch
    if problem:
        raise DataRefused(f"add_source: {problem}; the run goes on unchanged")
    source = Source(name, dataset, path=path, format=report.format, weight=cmd.weight)
    if cmd.weight == 0 and not any(s.weight > 0 for s in mixture.live()):
        raise DataRefused("add_source: at least one source must keep a weight above 0")
    mixture.add(source)
    return _changed(control, mixture, "add", _spec(mixture, name), report=report.summary(),
                    dropped=report.dropped, dropped_rows=[str(p) for p in report.problems])


def set_weight(control: Plane, cmd: SetWeight, reply: Reply) -> dict:
    mixture = mixture_of(control, "set_weight")
    source = _find(mixture, cmd.source, "set_weight")
    try:
        mixture.check_weights(source, cmd.weight)
    except DataError as e:
        raise DataRefused(f"set_weight: {e}") from None
    before = source.weight
    mixture.note_change()
    source.weight = cmd.weight
    return _changed(control, mixture, "weight", _spec(mixture, source.name), before=before)


def remove_source(control: Plane, cmd: RemoveSource, reply: Reply) -> dict:
    mixture = mixture_of(control, "remove_source")
    source = _find(mixture, cmd.source, "remove_source")
    try:
        mixture.check_weights(source, None)
    except DataError as e:
        raise DataRefused(f"remove_source: {e}") from None
    spec = _spec(mixture, source.name)
    mixture.note_change()
    source.removed = True
    return _changed(control, mixture, "remove", spec)


def _find(mixture: Mixture, name: str, label: str) -> Source:
    try:
        return mixture.find(name)
    except DataError as e:
        raise DataRefused(f"{label}: {e}") from None


def _spec(mixture: Mixture, name: str) -> dict:
    return next(d for d in mixture.describe() if d["name"] == name)


# -- teach --------------------------------------------------------------------------------------
def _inbox(control: Plane, mixture: Mixture) -> Source:
    """The run's inbox source (added, weight 0, on the first teach)."""
    for source in mixture.live():
        if source.kind == "inbox":
            return source
    trainer = control.trainer
    path = inbox_file.inbox_path(trainer.folder.root)
    dataset = InboxDataset(trainer.tokenizer, trainer.config.data.max_length, path,
                           pairs_as=pairs_as_for(trainer.config.preference.objective))
    source = Source(INBOX_SOURCE, dataset, path=str(path), format="inbox", weight=0.0, kind="inbox")
    mixture.add(source)
    return source


def teach(control: Plane, cmd: Teach, reply: Reply, prompt: str) -> dict:
    """`prompt`: the text the model continues (handlers.prompt_text: the chat template applied)."""
    trainer, cfg = control.trainer, control.trainer.config.teach
    mixture = mixture_of(control, "teach")
    _check_kind(control, cmd)
    try:
        encoded = encode_pair(trainer.tokenizer, prompt, cmd.answer, trainer.config.data.max_length, cmd.rejected)
    except inbox_file.InboxError as e:
        raise DataRefused(str(e)) from None
    step = trainer.state.global_step
    old = _greedy(control, prompt)
    source = _inbox(control, mixture)
    entry_id, error = None, None
    if control.rank == 0:  # durable before anything changes in memory, and before the answer
        try:
            entry_id = inbox_file.next_id(Path(source.path))
            inbox_file.add_entry(Path(source.path), entry_id, prompt, cmd.answer, step, cmd.rejected)
        except OSError as e:
            error = f"teach: the inbox {source.path} could not be written: {e}"
    entry_id, error = _from_rank0(control, (entry_id, error))
    if error:
        raise DataRefused(error)
    indices = source.dataset.add(entry_id, prompt, cmd.answer, cmd.rejected)  # a KTO run's pair: two
    pair = _pair_rows(encoded) if cmd.rejected is not None else None
    margin = {"margin": _margin(control, pair)} if pair is not None else {}
    per_step = cfg.per_step if cmd.per_step is None else cmd.per_step
    steps = cfg.steps if cmd.steps is None else cmd.steps
    if per_step and steps:
        mixture.note_change()
        mixture.schedules += [{"source": mixture.key_of(source), "index": index, "per_step": per_step,
                               "steps_left": steps, "id": entry_id} for index in indices]
    if cmd.weight is not None:
        source.weight = cmd.weight
    check_after = cfg.check_after if cmd.check_after is None else cmd.check_after
    if check_after:
        mixture.checks.append({"id": entry_id, "prompt": prompt, "answer": cmd.answer, "old": old,
                               "taught_at_step": step, "due_step": step + check_after,
                               **({"pair": pair, **margin} if pair is not None else {})})
    event = {"id": entry_id, "prompt": prompt, "answer": cmd.answer, "old": old, "per_step": per_step,
             "steps": steps, "check_at_step": step + check_after if check_after else None,
             **({"rejected": cmd.rejected} if cmd.rejected is not None else {}), **margin}
    trainer.emit(TeachEvent(step=step, **event))
    return {"step": step, **event, "applies_from_step": step + 1, "sources": mixture.describe()}


def _check_kind(control: Plane, cmd: Teach) -> None:
    """A pair (with `rejected`) trains every run that can take one (engine.objectives.preference_step.
    pairs_problem: an SFT run adds a pair loss, kto takes two judged answers); an answer alone
    trains SFT runs only."""
    trainer = control.trainer
    if cmd.rejected is not None:
        problem = pairs_problem(trainer)
        if problem:
            raise DataRefused(f"teach: {problem}; teach the better answer alone (no `rejected`)")
        return
    problem = rows_problem(trainer.config, "input_output", "a taught answer")
    if problem:
        raise DataRefused(f"teach: {problem}; teach with `rejected` (RunClient.prefer)")


def _pair_rows(sample: dict) -> dict:
    """A preference sample's two token rows and where their answers start."""
    prompt = sample["prompt_ids"]
    return {"rows": [prompt + sample["chosen_ids"], prompt + sample["rejected_ids"]], "start": len(prompt)}


def _margin(control: Plane, pair: dict) -> float:
    """log p(chosen) - log p(rejected) under the live weights, answers' tokens summed (collective)."""
    chosen, rejected = score(control.trainer.ctx, pair["rows"])
    start = pair["start"]
    return float(sum(chosen.logprobs[start:]) - sum(rejected.logprobs[start:]))  # type: ignore[arg-type]


def _greedy(control: Plane, prompt: str) -> str:
    """The live model's greedy answer (collective)."""
    limit = control.trainer.config.teach.max_new_tokens
    return generate_text(control.trainer.ctx, [prompt], max_new_tokens=limit, temperature=0.0)[0]


def inbox(control: Plane, cmd: Inbox, reply: Reply) -> dict:
    mixture = mixture_of(control, "inbox")
    entries: list[dict] = []
    for source in mixture.sources:
        if source.kind != "inbox":
            continue
        data = source.dataset
        left = {p["id"]: p["steps_left"] for p in mixture.schedules}
        for entry_id, (prompt, answer), rejected in zip(data.ids, data.pairs, data.rejected):
            entries.append({"id": entry_id, "prompt": prompt, "answer": answer,
                            "removed": entry_id in data.forgotten or source.removed,
                            "steps_left": left.get(entry_id, 0),
                            **({"rejected": rejected} if rejected is not None else {})})
    return {"step": control.trainer.state.global_step, "entries": entries,
            "sources": mixture.describe()}


def forget(control: Plane, cmd: Forget, reply: Reply) -> dict:
    trainer = control.trainer
    mixture = mixture_of(control, "forget")
    source = next((s for s in mixture.live() if s.kind == "inbox"), None)
    if source is None or cmd.id not in source.dataset.ids:
        known = ", ".join(source.dataset.ids) if source is not None else "none"
        raise DataRefused(f"forget: no inbox entry {cmd.id!r}; the entries are {known}")
    if cmd.id in source.dataset.forgotten:
        raise DataRefused(f"forget: entry {cmd.id!r} is forgotten already")
    error = None
    if control.rank == 0:
        try:
            inbox_file.forget_entry(Path(source.path), cmd.id, trainer.state.global_step)
        except OSError as e:
            error = f"forget: the inbox {source.path} could not be written: {e}"
    error = _from_rank0(control, error)
    if error:
        raise DataRefused(error)
    source.dataset.forget(cmd.id)
    mixture.checks = [c for c in mixture.checks if c["id"] != cmd.id]
    return _changed(control, mixture, "forget", _spec(mixture, source.name), id=cmd.id)


# -- at every boundary ------------------------------------------------------------------------------
def at_boundary(control: Plane) -> None:
    """Ask the taught prompts whose check is due again (collective: every rank calls it)."""
    mixture = getattr(control.trainer.train_dataset, "mixture", None)
    if mixture is None or not mixture.checks:
        return
    step = control.trainer.state.global_step
    due = [c for c in mixture.checks if c["due_step"] <= step]
    if not due:
        return
    mixture.checks = [c for c in mixture.checks if c["due_step"] > step]
    for check in due:
        new = _greedy(control, check["prompt"])
        margins = {}
        if "pair" in check:  # a preference: which answer the model now prefers, by how much
            after = _margin(control, check["pair"])
            margins = {"margin_before": check["margin"], "margin_after": after,
                       "prefers": "chosen" if after > 0 else "rejected"}
        control.trainer.emit(TeachCheckEvent(
            step=step, id=check["id"], prompt=check["prompt"], answer=check["answer"], old=check["old"],
            new=new, taught_at_step=check["taught_at_step"], steps=step - check["taught_at_step"],
            learned=new.strip() == check["answer"].strip(), **margins))


def sources_snapshot(control: Plane) -> list[dict] | None:
    """The sources as rank 0 sees them now (read from the server thread: a copy, or None)."""
    mixture = getattr(control.trainer.train_dataset, "mixture", None)
    if mixture is None:
        return None
    try:
        return mixture.describe()
    except Exception:  # noqa: BLE001 - changed while read: the next status has it
        return None
