"""Persistence models: which crash states a power cut after a prefix of a trace may leave.

A model looks at the operations issued before the cut (a prefix of the trace)
and sorts them: what is *durable* (on disk whatever happened next) and what
is *floating* (on disk, or not). It yields a :class:`CrashSpace`; a
:class:`CrashState` is one choice inside it. Models are parameters of the
explorer, so the guarantee can be checked against a weak model and compared
with a stronger one:

- :class:`PosixMinimal` (the guarantee): a metadata change (create, mkdir,
  symlink, link, rename, unlink, rmdir) is durable once every directory it
  touched was fsynced after it; until then it may be lost, in any
  combination with the others (a rename is atomic: both of its halves or
  neither). A file's data written before its last ``fsync``/``fdatasync``
  is durable. What was written (or truncated) after it reached the disk as
  a prefix, in the order it was issued, cut at any 4 KiB block of the file:
  every write (the pieces of a write, one per block it touches) is one step.
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

The ledger is no exception: SQLite's database file and WAL are files, their
writes and fsyncs calls of the trace like any other, so which commits
survive follows from what SQLite really synced, and WAL recovery runs for
real when a crash state is reopened.
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
class Piece:
    """One step of a file's data: ``data`` written at ``offset`` (within one block), or
    the file cut to ``offset`` bytes (``data`` None), by op ``op``."""

    op: int
    offset: int
    data: bytes | None


@dataclass(frozen=True)
class CrashSpace:
    """Everything a cut after ``trace.ops[:prefix]`` may leave, under one model."""

    prefix: int
    pinned: frozenset[int]  # metadata ops that are durable
    floating: tuple[int, ...]  # metadata ops that may or may not be on disk, in order
    ordered: bool  # floating ops persist as a prefix (a journal), else as any subset
    pieces: dict[int, tuple[Piece, ...]]  # each written file's data steps, in order
    partial: tuple[tuple[int, tuple[int, ...]], ...]  # files not all durable: how many
    # of their pieces may be on disk, the durable count first
    floors: dict[int, tuple[int, int]] = field(default_factory=dict)  # a floating op that,
    # if on disk, brings a file's data with it: op index -> (inode, pieces)

    def metadata_choices(self) -> int:
        n = len(self.floating)
        return n + 1 if self.ordered else 2**n

    def size(self) -> int:
        return self.metadata_choices() * math.prod(len(cuts) for _, cuts in self.partial)


@dataclass(frozen=True)
class CrashState:
    """One state in a space: which floating metadata ops reached the disk, and how many
    pieces of each file's unsynced data."""

    prefix: int
    kept: frozenset[int]
    counts: tuple[tuple[int, int], ...]


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
        pieces, partial = file_data(ops, self.block, {})
        return CrashSpace(prefix, frozenset(pinned), tuple(floating), False, pieces, partial)


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
        forced: dict[int, int] = {}  # inode -> the op before which its data is durable
        bringing = [op for op in ops if op.ino is not None and _brings_data(op)]
        for op in bringing:
            if op.index < journal and op.ino is not None:
                forced[op.ino] = max(forced.get(op.ino, 0), op.index)
        pieces, partial = file_data(ops, self.block, forced)
        floors = {
            op.index: (op.ino, sum(1 for p in pieces.get(op.ino, ()) if p.op < op.index))
            for op in bringing
            if op.index > journal and op.ino is not None
        }
        return CrashSpace(prefix, frozenset(pinned), tuple(floating), True, pieces, partial, floors)


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
    ops: list[Op], block: int, forced: dict[int, int]
) -> tuple[dict[int, tuple[Piece, ...]], tuple[tuple[int, tuple[int, ...]], ...]]:
    """Each written file's pieces in the prefix, and for each file whose data is not all
    durable the counts of pieces that may be on disk: the durable count (the pieces
    issued before its last fsync, or before ``forced[ino]``), then every count to all."""
    pieces: dict[int, list[Piece]] = {}
    synced: dict[int, int] = dict(forced)  # inode -> ops before this index are durable
    for op in ops:
        if op.ino is None:
            continue
        if op.kind == "write":
            pieces.setdefault(op.ino, []).extend(split_write(op, block))
        elif op.kind == "truncate":
            pieces.setdefault(op.ino, []).append(Piece(op.index, op.length, None))
        elif op.kind == "fsync":
            synced[op.ino] = max(synced.get(op.ino, 0), op.index)
    partial = []
    for ino, steps in sorted(pieces.items()):
        done = sum(1 for p in steps if p.op < synced.get(ino, -1))
        if done < len(steps):
            partial.append((ino, tuple(range(done, len(steps) + 1))))
    return {ino: tuple(steps) for ino, steps in pieces.items()}, tuple(partial)


def split_write(op: Op, block: int) -> list[Piece]:
    """A write's pieces: one per block of the file it touches."""
    out, offset, data = [], op.offset, op.data
    while data:
        n = min(len(data), block - offset % block)
        out.append(Piece(op.index, offset, data[:n]))
        offset, data = offset + n, data[n:]
    return out


def apply(content: bytes, pieces: tuple[Piece, ...]) -> bytes:
    """A file's bytes after ``pieces``, from ``content``."""
    out = bytearray(content)
    for piece in pieces:
        if piece.data is None:
            del out[piece.offset :]
            out += bytes(max(0, piece.offset - len(out)))
            continue
        if len(out) < piece.offset:
            out += bytes(piece.offset - len(out))
        out[piece.offset : piece.offset + len(piece.data)] = piece.data
    return bytes(out)


def step_counts(space: CrashSpace, ino: int, cuts: tuple[int, ...]) -> tuple[int, ...]:
    """The counts worth a structured state: each write whole (a count that ends at an
    op's last piece) and each write torn after its first piece."""
    steps = space.pieces[ino]

    def starts_op(i: int) -> bool:
        return i == 0 or steps[i - 1].op != steps[i].op

    chosen = []
    for n in cuts[:-1]:
        if n == cuts[0] or starts_op(n) or starts_op(n - 1):
            chosen.append(n)
    return tuple(chosen)


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
    for kept, counts in itertools.product(_metadata_options(space), itertools.product(*cuts)):
        yield CrashState(space.prefix, kept, tuple(counts))


def _metadata_options(space: CrashSpace) -> Iterator[frozenset[int]]:
    floating = space.floating
    if space.ordered:
        for n in range(len(floating) + 1):
            yield frozenset(floating[:n])
        return
    for chosen in itertools.product((False, True), repeat=len(floating)):
        yield frozenset(i for i, keep in zip(floating, chosen, strict=True) if keep)


def _structured(space: CrashSpace) -> Iterator[CrashState]:
    """The extremes, then each floating op alone lost or kept, each file alone cut
    after each of its unsynced writes (or torn inside one)."""
    everything = frozenset(space.floating)
    most = tuple((ino, cuts[-1]) for ino, cuts in space.partial)
    least = tuple((ino, cuts[0]) for ino, cuts in space.partial)
    for kept, counts in itertools.product((everything, frozenset()), (most, least)):
        yield CrashState(space.prefix, kept, counts)
    singles: list[frozenset[int]] = []
    if space.ordered:
        singles = [frozenset(space.floating[:n]) for n in range(1, len(space.floating))]
    else:
        for i in space.floating:
            singles += [everything - {i}, frozenset({i})]
    for kept in singles:
        yield CrashState(space.prefix, kept, most)
    for k, (ino, cuts) in enumerate(space.partial):
        for n in step_counts(space, ino, cuts):
            counts = (*most[:k], (ino, n), *most[k + 1 :])
            yield CrashState(space.prefix, everything, counts)


def _sampled(space: CrashSpace, budget: Budget) -> Iterator[CrashState]:
    rng = random.Random(f"{budget.seed}:{space.prefix}")
    for _ in range(budget.samples):
        if space.ordered:
            kept = frozenset(space.floating[: rng.randint(0, len(space.floating))])
        else:
            kept = frozenset(i for i in space.floating if rng.random() < 0.5)
        counts = tuple((ino, rng.choice(cuts)) for ino, cuts in space.partial)
        yield CrashState(space.prefix, kept, counts)
