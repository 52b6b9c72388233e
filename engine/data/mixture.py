"""Data sources with weights: the run's batches drawn from a mixture, deterministically.

Every run's training data is a :class:`MixtureDataset` of named sources (`data.sources`, or the
one-source shorthand `data.train`, named "train"). Each source has its own *stream*: the samples
in the order the plain :class:`~engine.data.sampler.DistributedBatchSampler` would train them,
epoch after epoch (its global batches flattened; a source smaller than one global batch is
permuted per pass instead). Global batch `t` of the run is then:

1. the fixed slots: each teach schedule (k samples of one inbox entry per batch for n batches);
2. the other slots, each from a source chosen by weight: the source's next stream samples. The
   choice is drawn from `numpy.random.default_rng([seed, MIX, t])`; with one weighted source
   no random number is drawn at all.

Every rank computes the same global batch (the weights and streams change only at the step
boundary, on every rank alike) and takes its share, slots `[rank::dp_size]`, exactly as the plain
sampler does. With a single source, the batches are therefore bit for bit those of the plain
sampler: the golden-loss runs do not change.

The state -- batches drawn, each source's samples drawn so far (its stream position), weights,
schedules, the live-added sources' files -- is the data position saved in checkpoints
(`state_dict` / `load_state_dict`), so a resume draws the same batches. A mixture "epoch" is the
whole start mixture's samples divided by the global batch (for one source: the plain epoch); it
only paces the loop (eval / checkpoint every n epochs), streams wrap on their own.

The loader of a mixture has no worker processes: batches are drawn lazily, one step at a time, so
a change made at a boundary applies from the very next step (tokenized samples are in memory;
collation is cheap).
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
from torch.utils.data import Dataset, Sampler

from engine.data.packing import PackedDataset
from contract.data_rows import DataError
from engine.data.sampler import DistributedBatchSampler

MIX = 0x6D6978  # tags the mixture's random stream apart from the samplers' own
HISTORY = 64    # draws whose start state is kept (a checkpoint may name a slightly earlier batch)

Builder = Callable[[dict], Any]  # a saved source spec -> its tokenized dataset (at resume)


@dataclass
class Source:
    """One named source: its samples and where the run is in them."""
    name: str
    dataset: Any
    path: str = ""
    format: str = "auto"
    weight: float = 1.0
    kind: str = "file"              # "file" or "inbox" (samples taught from the chat)
    consumed: int = 0               # samples drawn from its stream so far (all ranks)
    removed: bool = False
    samples: int = 0                # samples it held when added (checked at resume)
    seed: int = 0
    view: Any = None                # the (packed) dataset the stream indexes

    def spec(self) -> dict:
        """What a checkpoint records of it (plain values)."""
        return {"name": self.name, "path": self.path, "format": self.format, "weight": self.weight,
                "kind": self.kind, "consumed": self.consumed, "removed": self.removed,
                "samples": self.samples, "seed": self.seed}

    def usable(self) -> list[int]:
        """Indices the stream may give (an inbox leaves out forgotten entries)."""
        return self.dataset.active() if self.kind == "inbox" else list(range(len(self.view)))

    def has_samples(self) -> bool:
        return bool(self.dataset.active()) if self.kind == "inbox" else len(self.view) > 0

    def gives(self, index: int) -> bool:
        """Whether sample `index` may still be drawn (not a forgotten inbox entry)."""
        return index in self.dataset.active() if self.kind == "inbox" else 0 <= index < len(self.view)


def source_seed(seed: int, name: str, first: bool) -> int:
    """The first source streams with the run's seed (the plain sampler's order), others with a
    seed of their own derived from their name."""
    return seed if first else (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


class MixtureDataset(Dataset):
    """The run's training samples: item `(source key, index)` is sample `index` of source `key`.
    `mixture` (made by the loader, once) draws the batches; `sources` holds every source ever
    added, removed ones included, so that keys stay valid."""

    def __init__(self, sources: list[Source], build: Builder | None = None):
        if not sources:
            raise DataError("data: no training source")
        self.sources = sources
        self.build = build
        self.mixture: Mixture | None = None

    def __len__(self) -> int:
        return sum(len(s.dataset) for s in self.sources if not s.removed)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        source, index = key
        return self.sources[source].view[index]

    def batch_sampler(self, *, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                      strategy: str, max_length: int) -> "MixtureBatchSampler":
        """This rank's view of the (one, persistent) mixture; made on the first call."""
        if self.mixture is None:
            self.mixture = Mixture(self, micro_batch_size, dp_size, seed, strategy, max_length)
        return MixtureBatchSampler(self.mixture, dp_rank)


class Mixture:
    """The run's batch drawing (one per process, identical on every rank)."""

    def __init__(self, data: MixtureDataset, micro_batch_size: int, dp_size: int, seed: int,
                 strategy: str, max_length: int):
        self.data, self.sources = data, data.sources
        self.micro, self.dp_size, self.seed = micro_batch_size, dp_size, seed
        self.strategy, self.max_length = strategy, max_length
        self.global_size = micro_batch_size * dp_size
        for source in self.sources:
            self._prepare(source)
        total = sum(len(s.view) for s in self.sources)
        if total < self.global_size:
            raise DataError(f"{total} samples are too few for {dp_size} ranks with micro_batch_size "
                            f"{micro_batch_size} (need at least {self.global_size})")
        self.num_batches = total // self.global_size  # a mixture epoch, fixed at start
        self.drawn = 0                       # global batches drawn
        self.schedules: list[dict] = []      # fixed slots: {source, index, per_step, steps_left, id}
        self.checks: list[dict] = []         # teach checks due (engine.data.inbox)
        self.step_counts: dict[str, int] = {}
        self._history: dict[int, dict] = {}
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source key -> (pass, order)
        self.loads = 0  # states loaded (a rewind ends the epoch views drawing from before it)
        # the state before the first batch, and whether the run since is its plain continuation
        # (no live change): then any earlier position can be drawn again from it (`detached`)
        self._start = self.snapshot()
        self.replayable = True

    # -- sources ----------------------------------------------------------------------------------
    def _prepare(self, source: Source) -> None:
        source.view = (PackedDataset(source.dataset, self.max_length)
                       if self.strategy == "packing" and source.kind == "file" else source.dataset)
        source.samples = source.samples or len(source.dataset)

    def live(self) -> list[Source]:
        return [s for s in self.sources if not s.removed]

    def find(self, name: str) -> Source:
        for source in self.live():
            if source.name == name:
                return source
        raise DataError(f"no source named {name!r}; the sources are: "
                        f"{', '.join(s.name for s in self.live())}")

    def note_change(self) -> None:
        """A live change (weight, removal, teach schedule): earlier positions no longer replay."""
        self.replayable = False

    def add(self, source: Source) -> int:
        """Add a source (its name must be new among the live ones); returns its key."""
        self.note_change()
        if any(s.name == source.name for s in self.live()):
            raise DataError(f"a source named {source.name!r} exists already; give another name")
        source.seed = source_seed(self.seed, f"{source.name}#{len(self.sources)}", first=False)
        self._prepare(source)
        self.sources.append(source)
        return len(self.sources) - 1

    def key_of(self, source: Source) -> int:
        return next(i for i, s in enumerate(self.sources) if s is source)

    def check_weights(self, changed: Source, weight: float | None) -> None:
        """Refuse a change that would leave no live source with weight > 0 (None: removing it)."""
        left = [s for s in self.live() if s is not changed and s.weight > 0 and s.has_samples()]
        if not left and not (weight and weight > 0 and changed.has_samples()):
            raise DataError("at least one source must keep a weight above 0 (pause one only while "
                            "another one trains)")

    # -- drawing ----------------------------------------------------------------------------------
    def draw(self) -> list[tuple[int, int]]:
        """The next global batch: (source key, sample index) per slot."""
        self._history[self.drawn] = self.snapshot()
        self._history.pop(self.drawn - HISTORY, None)
        slots: list[tuple[int, int]] = []
        for plan in self.schedules:
            source = self.sources[plan["source"]]
            if plan["steps_left"] <= 0 or source.removed or not source.gives(plan["index"]):
                continue
            take = min(plan["per_step"], self.global_size - len(slots))
            slots += [(plan["source"], plan["index"])] * take
            plan["steps_left"] -= 1
        self.schedules = [p for p in self.schedules if p["steps_left"] > 0]
        weighted = [i for i, s in enumerate(self.sources) if not s.removed and s.weight > 0 and s.has_samples()]
        rest = self.global_size - len(slots)
        if rest and len(weighted) == 1:  # one source: no random draw (the plain sampler's batches)
            slots += [(weighted[0], i) for i in self._take(weighted[0], rest)]
        elif rest:
            weights = np.array([self.sources[i].weight for i in weighted], dtype=np.float64)
            rng = np.random.default_rng([self.seed % 2**63, MIX, self.drawn])
            picks = rng.choice(len(weighted), size=rest, p=weights / weights.sum())
            # each source's samples in stream order, placed at the slots that picked it
            taken = {k: iter(self._take(weighted[k], int(n))) for k, n in
                     zip(*np.unique(picks, return_counts=True))}
            slots += [(weighted[k], next(taken[k])) for k in picks.tolist()]
        for key, n in zip(*np.unique([k for k, _ in slots], return_counts=True)):
            name = self.sources[int(key)].name
            self.step_counts[name] = self.step_counts.get(name, 0) + int(n)
        self.drawn += 1
        return slots

    def _take(self, key: int, n: int) -> list[int]:
        """The next `n` samples of source `key`'s stream (a slice of its pass where it can)."""
        source = self.sources[key]
        if source.kind == "inbox":
            return [self._next(key) for _ in range(n)]
        out: list[int] = []
        size = self._pass_size(source)
        while len(out) < n:
            number, offset = divmod(source.consumed, size)
            part = self._order(key, number)[offset:offset + n - len(out)].tolist()
            out += part
            source.consumed += len(part)
        return out

    def _next(self, key: int) -> int:
        """The next sample of source `key`'s stream."""
        source = self.sources[key]
        if source.kind == "inbox":  # a handful of entries: round robin over those not forgotten
            active = source.usable()
            index = active[source.consumed % len(active)]
        else:
            size = self._pass_size(source)
            number, offset = divmod(source.consumed, size)
            index = int(self._order(key, number)[offset])
        source.consumed += 1
        return index

    def _pass_size(self, source: Source) -> int:
        n = len(source.view)
        return (n // self.global_size) * self.global_size if n >= self.global_size else n

    def _order(self, key: int, number: int) -> np.ndarray:
        cached = self._orders.get(key)
        if cached is not None and cached[0] == number:
            return cached[1]
        source = self.sources[key]
        n = len(source.view)
        if n >= self.global_size:
            lengths = list(source.view.lengths) if hasattr(source.view, "lengths") else n
            plain = DistributedBatchSampler(lengths, self.micro, 0, self.dp_size, seed=source.seed,
                                            strategy=self.strategy, drop_last=True, shuffle=True)
            order = np.concatenate([np.asarray(b) for b in plain.global_batches(number)])
        else:
            order = np.random.default_rng([source.seed % 2**63, number]).permutation(n)
        self._orders[key] = (number, order)
        return order

    def take_counts(self) -> dict[str, int]:
        """Samples drawn per source since the last call (all ranks together)."""
        counts, self.step_counts = self.step_counts, {}
        return counts

    # -- the data position ------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {"drawn": self.drawn, "sources": [s.spec() for s in self.sources],
                "schedules": copy.deepcopy(self.schedules), "checks": copy.deepcopy(self.checks),
                "inbox": [s.dataset.state_dict() for s in self.sources if s.kind == "inbox"]}

    def state_at(self, drawn: int) -> dict:
        """The state before global batch `drawn` (the present one, or a recent one)."""
        if drawn == self.drawn:
            return self.snapshot()
        if drawn in self._history:
            return copy.deepcopy(self._history[drawn])
        raise DataError(f"the data position of batch {drawn} is no longer known (now at {self.drawn})")

    def fingerprint(self) -> dict:
        return {"seed": self.seed, "strategy": self.strategy, "batch_size": self.micro,
                "dp_size": self.dp_size, "num_batches": self.num_batches}

    def load(self, state: dict) -> None:
        """Go on from a saved state: sources added live are rebuilt from their files."""
        saved = state["sources"]
        for key, spec in enumerate(saved):
            if key < len(self.sources):
                source = self.sources[key]
                if source.name != spec["name"] or source.kind != spec["kind"]:
                    raise DataError(f"source {key} is {source.name!r} in this run but was {spec['name']!r}")
            else:
                if self.data.build is None:
                    raise DataError(f"source {spec['name']!r} was added live; this run cannot rebuild it")
                source = Source(spec["name"], self.data.build(spec), path=spec["path"], format=spec["format"],
                                kind=spec["kind"])
                self._prepare(source)
                self.sources.append(source)
            if source.kind == "file" and spec["samples"] != len(source.dataset):
                raise DataError(f"source {spec['name']!r} ({spec['path'] or 'as configured'}) holds "
                                f"{len(source.dataset)} samples now, {spec['samples']} at the checkpoint")
            for name in ("weight", "consumed", "removed", "samples", "seed"):
                setattr(source, name, spec[name])
        del self.sources[len(saved):]
        inboxes = iter(state.get("inbox", []))
        for source in self.sources:
            if source.kind == "inbox":
                source.dataset.load_state_dict(next(inboxes))
        self.drawn = int(state["drawn"])
        self.replayable = self._plain(state)
        self.schedules = copy.deepcopy(state.get("schedules", []))
        self.checks = copy.deepcopy(state.get("checks", []))
        self._history, self._orders = {}, {}
        self.loads += 1

    def _plain(self, state: dict) -> bool:
        """`state` has the start's sources, weights and no schedule: no live change led to it."""
        start, now = self._start["sources"], state["sources"]
        same = len(start) == len(now) and all(
            a["name"] == b["name"] and a["weight"] == b["weight"] and a["removed"] == b["removed"]
            for a, b in zip(start, now))
        return same and not state.get("schedules") and not state.get("checks")

    def detached(self, drawn: int) -> "Mixture":
        """A copy positioned before global batch `drawn`, drawing without moving the run's own
        position: for a view away from it (a script reading epoch 0's batches after training,
        engine.trainer.Trainer.train_loader). The datasets are shared, nothing of them changes.
        Raises DataError when that position cannot be known (live changes before it)."""
        if any(s.kind == "inbox" for s in self.sources):
            raise DataError(f"the mixture has drawn {self.drawn} batches and holds taught samples: "
                            f"batch {drawn} cannot be drawn again apart from the run")
        other = copy.copy(self)
        other.sources = [copy.copy(s) for s in self.sources]
        other.schedules, other.checks, other.step_counts = [], [], {}
        other._history, other._orders = {}, dict(self._orders)
        if drawn in self._history or drawn == self.drawn:
            other._restore(self.state_at(drawn))
        elif self.replayable:
            other._restore(copy.deepcopy(self._start))
            while other.drawn < drawn:
                other.draw()
        else:
            raise DataError(f"the mixture has drawn {self.drawn} batches, but this epoch view starts at "
                            f"batch {drawn}, before live data changes: load the checkpoint's data position first")
        return other

    def _restore(self, state: dict) -> None:
        """A detached copy's position from `state` (its sources exist already; no rebuild)."""
        for source, spec in zip(self.sources, state["sources"]):
            for name in ("weight", "consumed", "removed", "samples", "seed"):
                setattr(source, name, spec[name])
        del self.sources[len(state["sources"]):]
        self.drawn = int(state["drawn"])
        self.schedules = copy.deepcopy(state.get("schedules", []))
        self.checks = copy.deepcopy(state.get("checks", []))

    def describe(self) -> list[dict]:
        """The live sources for events and status: name, path, format, weight, samples, seen."""
        return [{"name": s.name, "path": s.path, "format": s.format, "weight": s.weight, "kind": s.kind,
                 "samples": len(s.usable()), "seen": s.consumed,
                 "scheduled": sum(p["per_step"] * p["steps_left"] for p in self.schedules
                                  if self.sources[p["source"]] is s)} for s in self.live()]


class MixtureBatchSampler(Sampler[list[tuple[int, int]]]):
    """One rank's batches of one mixture epoch: `set_epoch` / `set_start_batch` place the view;
    the draws themselves continue the mixture's state (the loop asks for the epochs in order)."""

    def __init__(self, mixture: Mixture, dp_rank: int):
        self.mixture, self.dp_rank = mixture, dp_rank
        self.epoch, self.start_batch = 0, 0

    @property
    def num_batches(self) -> int:
        return self.mixture.num_batches

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.start_batch = epoch, 0

    def set_start_batch(self, batch: int) -> None:
        if not 0 <= batch <= self.num_batches:
            raise DataError(f"start batch {batch} is outside the epoch's 0..{self.num_batches} batches")
        self.start_batch = batch

    def __len__(self) -> int:
        return self.num_batches - self.start_batch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        mixture, first = self.mixture, self.epoch * self.num_batches + self.start_batch
        if mixture.drawn > first:  # behind the run's position: drawn again from a copy
            mixture = mixture.detached(first)
        elif mixture.drawn != first:
            raise DataError(f"the mixture has drawn {mixture.drawn} batches, but this epoch view "
                            f"starts at batch {first}: load the checkpoint's data position first")
        loads = mixture.loads
        for _ in range(len(self)):
            if mixture.loads != loads:  # rewound in place: the loop starts a new view from there
                return
            yield mixture.draw()[self.dp_rank::mixture.dp_size]

    def state_dict(self, batches_done: int | None = None) -> dict:
        """The data position after `batches_done` batches of the view's epoch (default: now)."""
        m = self.mixture
        drawn = m.drawn if batches_done is None else self.epoch * m.num_batches + batches_done
        epoch, batch = divmod(drawn, m.num_batches)
        return {"epoch": epoch, "batch": batch, **m.fingerprint(), "mixture": m.state_at(drawn)}

    def load_state_dict(self, state: dict) -> None:
        """Go on from `state`; refuses one of a different order (seed, sizes, strategy ...)."""
        m = self.mixture
        if "mixture" not in state:  # a plain sampler's state: one source, `epoch` x `batch` batches
            state = _from_plain(state, m)
        differ = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in m.fingerprint().items()
                  if state.get(k) != v]
        if differ:
            raise DataError("cannot resume the data order exactly, the data differ: " + "; ".join(differ))
        m.load(state["mixture"])
        self.set_epoch(int(state["epoch"]))
        self.set_start_batch(int(state["batch"]))


def _from_plain(state: dict, m: Mixture) -> dict:
    if len(m.sources) != 1 or state.get("num_samples") != len(m.sources[0].view):
        raise DataError("cannot resume: the checkpoint has one source's position, this run has other data")
    drawn = int(state["epoch"]) * m.num_batches + int(state["batch"])
    spec = {**m.sources[0].spec(), "consumed": drawn * m.global_size}
    return {**state, "num_batches": m.num_batches,
            "mixture": {"drawn": drawn, "sources": [spec], "schedules": [], "checks": []}}


def sources_summary(sources: list[Source]) -> dict[str, Any]:
    """Name -> samples, for the setup event."""
    return {s.name: len(s.dataset) for s in sources}


__all__ = ["Mixture", "MixtureBatchSampler", "MixtureDataset", "Source", "source_seed", "sources_summary"]
