"""Persistence models: which crash states a power cut after a prefix of a trace may leave.

A model looks at the operations issued before the cut (a prefix of the trace)
and sorts them: what is *durable* (on disk whatever happened next) and what
is *floating* (on disk, or not). It yields a :class:`CrashSpace`; a
:class:`CrashState` is one choice inside it. Models are parameters of the
explorer, so the guarantee can be checked against a weak model and compared
with a stronger one:

- :class:`PosixMinimal` (the guarantee): a metadata change (create, mkdir,
  rename, unlink, rmdir) is durable once every directory it touched was
  fsynced after it; until then it may be lost, in any combination with the
  others (a rename is atomic: both of its halves or neither). A file's data
  is durable up to the length its last fsync saw; beyond that, any prefix of
  block-sized pieces may have reached the disk, or none of it.
- :class:`Ext4Ordered` (for comparison): metadata goes through one journal,
  so floating changes persist as a prefix, in order, and any fsync (of a
  file or a directory) commits the journal; data as above, except that a
  rename over an existing file brings the renamed file's data with it
  (``auto_da_alloc``).

- :class:`ObjectStore` (a run whose ``save_dir`` is on S3): the client
  machine loses power, the server does not. A request to the store answered
  before the cut took effect (an object completed is there with its bytes,
  an upload created is in progress, an abort or a delete is done); a
  request sent and not answered may or may not have taken effect, in any
  combination with the others (the server handles requests independently).
  The run's local files (its root) follow POSIX-minimal.

The ledger (SQLite in WAL mode) is the same in all: a transaction committed
with ``synchronous=FULL`` is durable, and with it every earlier one; the
``NORMAL`` commits after the last FULL one may be lost, as a suffix. A state
picks one of the snapshots taken after those commits.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from .recording import Op, Trace

BLOCK = 4096


@dataclass(frozen=True)
class CrashSpace:
    """Everything a cut after ``trace.ops[:prefix]`` may leave, under one model."""

    prefix: int
    pinned: frozenset[int]  # metadata ops that are durable
    floating: tuple[int, ...]  # metadata ops that may or may not be on disk, in order
    ordered: bool  # floating ops persist as a prefix (a journal), else as any subset
    lengths: dict[int, int]  # each written file's length in the page cache at the cut
    partial: tuple[tuple[int, tuple[int, ...]], ...]  # files not all durable: the
    # lengths that may be on disk, the durable one first
    ledger: tuple[int | None, ...]  # snapshots the ledger may be left at, durable first
    floors: dict[int, tuple[int, int]] = field(default_factory=dict)  # a floating op that,
    # if on disk, brings a file's data with it: op index -> (inode, length)

    def metadata_choices(self) -> int:
        n = len(self.floating)
        return n + 1 if self.ordered else 2**n

    def size(self) -> int:
        return (
            self.metadata_choices()
            * math.prod(len(cuts) for _, cuts in self.partial)
            * len(self.ledger)
        )


@dataclass(frozen=True)
class CrashState:
    """One state in a space: which floating metadata ops reached the disk, how much of
    each file's unsynced data, and which ledger snapshot."""

    prefix: int
    kept: frozenset[int]
    lengths: tuple[tuple[int, int], ...]
    ledger: int | None


class PersistenceModel(Protocol):
    name: str

    def space(self, trace: Trace, prefix: int) -> CrashSpace: ...


@dataclass(frozen=True)
class PosixMinimal:
    """Only what an fsync or a directory fsync made durable is guaranteed."""

    block: int = BLOCK
    name: str = "posix-minimal"

    def space(self, trace: Trace, prefix: int) -> CrashSpace:
        ops = trace.ops[:prefix]
        synced: dict[int, list[int]] = {}
        for op in ops:
            if op.kind == "fsync_dir" and op.ino is not None:
                synced.setdefault(op.ino, []).append(op.index)
        pinned, floating = [], []
        for op in ops:
            if not op.effects:
                continue
            durable = all(any(i > op.index for i in synced.get(d, ())) for d in op.dirs)
            (pinned if durable else floating).append(op.index)
        lengths, partial = file_data(trace, ops, self.block, {})
        return CrashSpace(
            prefix, frozenset(pinned), tuple(floating), False, lengths, partial, ledger(trace, ops)
        )


@dataclass(frozen=True)
class Ext4Ordered:
    """ext4 ``data=ordered`` as far as the protocol can tell: one ordered journal."""

    block: int = BLOCK
    name: str = "ext4-ordered"

    def space(self, trace: Trace, prefix: int) -> CrashSpace:
        ops = trace.ops[:prefix]
        journal = max((op.index for op in ops if op.kind in ("fsync", "fsync_dir")), default=-1)
        meta = [op for op in ops if op.effects]
        pinned = [op.index for op in meta if op.index < journal]
        floating = [op.index for op in meta if op.index > journal]
        forced: dict[int, int] = {}
        floors: dict[int, tuple[int, int]] = {}
        for op in ops:
            if op.ino is not None and _brings_data(op):
                if op.index < journal:
                    forced[op.ino] = op.length
                else:
                    floors[op.index] = (op.ino, op.length)
        lengths, partial = file_data(trace, ops, self.block, forced)
        return CrashSpace(
            prefix,
            frozenset(pinned),
            tuple(floating),
            True,
            lengths,
            partial,
            ledger(trace, ops),
            floors,
        )


def _brings_data(op: Op) -> bool:
    """ext4's auto_da_alloc: a rename over an existing file flushes the renamed file."""
    return op.kind == "rename" and op.replaced is not None


#: The object-store requests of a trace (see :mod:`.objects`).
S3_REQUESTS = frozenset({"s3_create", "s3_complete", "s3_put", "s3_abort", "s3_delete"})


@dataclass(frozen=True)
class ObjectStore:
    """A power cut of the client of an object store (see the module docstring)."""

    local: PosixMinimal = PosixMinimal()
    name: str = "object-store"

    def space(self, trace: Trace, prefix: int) -> CrashSpace:
        space = self.local.space(trace, prefix)
        requests = [op for op in trace.ops[:prefix] if op.kind in S3_REQUESTS]
        answered = {op.index for op in requests if op.answered is not None and op.answered < prefix}
        unanswered = {op.index for op in requests} - answered
        return replace(
            space,
            pinned=space.pinned | answered,
            floating=tuple(sorted({*space.floating, *unanswered})),
        )


MODELS: dict[str, PersistenceModel] = {m.name: m for m in (PosixMinimal(), Ext4Ordered())}
#: The models of a run on object storage.
STORE_MODELS: dict[str, PersistenceModel] = {m.name: m for m in (ObjectStore(),)}


def file_data(
    trace: Trace, ops: list[Op], block: int, forced: dict[int, int]
) -> tuple[dict[int, int], tuple[tuple[int, tuple[int, ...]], ...]]:
    """Each file's length at the cut, and for each file whose data is not all durable
    the lengths that may be on disk: the durable one, each block boundary past it, all."""
    logical = dict(trace.base_lengths)
    durable = dict(trace.base_lengths)
    for op in ops:
        if op.ino is None:
            continue
        if op.kind == "write":
            logical[op.ino] = op.length
        elif op.kind == "fsync":
            durable[op.ino] = max(durable.get(op.ino, 0), op.length)
    for ino, n in forced.items():
        durable[ino] = max(durable.get(ino, 0), n)
    partial = []
    for ino, n in sorted(logical.items()):
        done = min(durable.get(ino, 0), n)
        if n > done:
            first = (done // block + 1) * block
            partial.append((ino, (done, *range(first, n, block), n)))
    return logical, tuple(partial)


def ledger(trace: Trace, ops: list[Op]) -> tuple[int | None, ...]:
    """The snapshots a cut may leave: the last FULL commit's (or the start's), then
    each NORMAL commit after it (a suffix of those may be lost)."""
    durable: int | None = trace.base_snapshot
    later: list[int | None] = []
    for op in ops:
        if op.kind != "commit":
            continue
        if op.durable:
            durable, later = op.snapshot, []
        else:
            later.append(op.snapshot)
    return tuple(dict.fromkeys([durable, *later]))


# ------------------------------------------------------------------ choosing states


@dataclass(frozen=True)
class Budget:
    """How many states of one prefix are explored.

    A prefix with at most ``exhaustive`` states is explored whole. A larger one
    gets the structured states (every extreme, and each floating operation or
    file alone lost or alone kept) and ``samples`` more drawn at random, with
    a generator seeded by ``seed`` and the prefix, so a run is repeatable.
    """

    exhaustive: int
    samples: int
    seed: int = 0


def crash_states(space: CrashSpace, budget: Budget) -> Iterator[CrashState]:
    if space.size() <= budget.exhaustive:
        yield from _every_state(space)
        return
    seen: set[CrashState] = set()
    for state in itertools.chain(_structured(space), _sampled(space, budget)):
        if state not in seen:
            seen.add(state)
            yield state


def _every_state(space: CrashSpace) -> Iterator[CrashState]:
    cuts = [[(ino, n) for n in options] for ino, options in space.partial]
    for kept, lengths, snap in itertools.product(
        _metadata_options(space), itertools.product(*cuts), space.ledger
    ):
        yield CrashState(space.prefix, kept, tuple(lengths), snap)


def _metadata_options(space: CrashSpace) -> Iterator[frozenset[int]]:
    floating = space.floating
    if space.ordered:
        for n in range(len(floating) + 1):
            yield frozenset(floating[:n])
        return
    for chosen in itertools.product((False, True), repeat=len(floating)):
        yield frozenset(i for i, keep in zip(floating, chosen, strict=True) if keep)


def _structured(space: CrashSpace) -> Iterator[CrashState]:
    """The extremes, then each floating op or file varied alone from them."""
    everything = frozenset(space.floating)
    most = tuple((ino, cuts[-1]) for ino, cuts in space.partial)
    least = tuple((ino, cuts[0]) for ino, cuts in space.partial)
    ledgers = dict.fromkeys((space.ledger[0], space.ledger[-1]))
    for kept, lengths, snap in itertools.product((everything, frozenset()), (most, least), ledgers):
        yield CrashState(space.prefix, kept, lengths, snap)
    for snap in space.ledger:
        yield CrashState(space.prefix, everything, most, snap)
    singles: list[frozenset[int]] = []
    if space.ordered:
        singles = [frozenset(space.floating[:n]) for n in range(1, len(space.floating))]
    else:
        for i in space.floating:
            singles += [everything - {i}, frozenset({i})]
    latest = space.ledger[-1]  # the most the ledger may claim, against one loss
    for kept in singles:
        yield CrashState(space.prefix, kept, most, latest)
    for k, (ino, cuts) in enumerate(space.partial):
        for n in cuts[:-1]:
            lengths = (*most[:k], (ino, n), *most[k + 1 :])
            yield CrashState(space.prefix, everything, lengths, latest)


def _sampled(space: CrashSpace, budget: Budget) -> Iterator[CrashState]:
    rng = random.Random(f"{budget.seed}:{space.prefix}")
    for _ in range(budget.samples):
        if space.ordered:
            kept = frozenset(space.floating[: rng.randint(0, len(space.floating))])
        else:
            kept = frozenset(i for i in space.floating if rng.random() < 0.5)
        lengths = tuple((ino, rng.choice(cuts)) for ino, cuts in space.partial)
        yield CrashState(space.prefix, kept, lengths, rng.choice(space.ledger))
