"""Exploring the crash states of a trace: materialize each one, reopen, check.

For each prefix of the trace (a power cut after that many operations) the
persistence model gives the space of states the disk may be in; the budget
picks the states explored (all of them when few). Each state is built in
memory first: states that leave the same files and the same ledger, with
the same saves acknowledged, are checked once. A new one is materialized in
the world directory (the recording's own files are gone by then), the run is
reopened there (which reconciles), and the check of the scenario runs: the
invariants (``check(load=True)``), and that every save acknowledged before
the cut is still committed and holds its payload, unless a later
acknowledged commit evicted it (the reference model of ``tests/crashlib.py``).

A run on object storage (:mod:`.objects`): the store's state is part of the
crash state, built under a fresh prefix of the real server for each state
checked, and the run is reopened there; after its reconcile, no multipart
upload may be left in progress and no object of a rolled-back (or deleted)
row may remain.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import sqlite3
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash
from crashlib import HEALTHY_STATES, Reference, integrity, ledger_rows, policies

from ckptdb import CheckpointManager

from .objects import StoreState, materialize_store, persisted_store, store_problems
from .persistence import (
    S3_REQUESTS,
    Budget,
    CrashSpace,
    CrashState,
    PersistenceModel,
    apply,
    crash_states,
)
from .recording import LEDGER_FILE, WORLD, Trace

#: How a scenario's state is checked: the run's root, the records of the cut's
#: prefix (``begin``/``ack``) and the ``save_dir`` the state's objects were built
#: in (None: a local run); returns the problems found.
Check = Callable[[Path, list[Mapping[str, Any]], str | None], list[str]]


@dataclass(frozen=True)
class Violation:
    state: str  # the crash state, described
    problems: list[str]

    def __str__(self) -> str:
        return f"{self.state}\n  " + "\n  ".join(self.problems)


@dataclass
class Exploration:
    """The figures of one exploration, and what it found."""

    scenario: str
    model: str
    ops: int
    crash_points: int = 0
    generated: int = 0
    explored: int = 0
    violations: list[Violation] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"{self.scenario} [{self.model}]: {self.ops} ops, {self.crash_points} crash points, "
            f"{self.generated} crash states generated, {self.explored} distinct explored, "
            f"{len(self.violations)} violations ({self.seconds:.1f} s)"
        )

    def report(self, limit: int = 3) -> str:
        shown = "\n".join(str(v) for v in self.violations[:limit])
        more = len(self.violations) - limit
        return (
            self.summary()
            + ("\n" + shown if shown else "")
            + (f"\n(+{more} more)" if more > 0 else "")
        )


@dataclass
class ReferenceCheck:
    """Reopen and verify against the reference model, starting from ``base`` (what
    was acknowledged before the recording began).

    The crash tests' checks (``tests/crashlib.py``), but for their second
    reconcile, which ``check`` already runs as a dry run: the invariants with
    every committed payload loaded, every acknowledged save committed unless a
    later acknowledged commit evicted it, nothing committed that no boundary
    explains, each payload from the boundary its row names, no row left
    pending, deleting, lost or corrupt, ``PRAGMA integrity_check`` ok.
    """

    base: Reference

    def __call__(
        self, root: Path, records: list[Mapping[str, Any]], save_dir: str | None = None
    ) -> list[str]:
        ref = copy.deepcopy(self.base)
        problems = ref.absorb_records(in_flight_records(records), ledger_rows(root))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # reconcile's repairs warn; the checks decide
                problems += _reopened(root, ref, save_dir)
        except Exception as exc:  # the finding itself: the run does not reopen
            problems.append(f"reopening the run raised {type(exc).__name__}: {exc}")
        if save_dir is not None:
            left = store_problems(save_dir, ledger_rows(root))
            problems += [f"after reconcile: {p}" for p in left]
        status = integrity(root)
        return problems + ([] if status == "ok" else [f"PRAGMA integrity_check: {status}"])


def in_flight_records(records: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The records the reference model reads: a boundary whose save raised (marked
    ``failed``) is no longer in flight once it failed, so its ``begin`` goes too, and
    a row it committed is one no boundary explains."""
    failed = {r["failed"] for r in records if "failed" in r}
    return [dict(r) for r in records if "failed" not in r and r.get("begin") not in failed]


def _reopened(root: Path, ref: Reference, save_dir: str | None) -> list[str]:
    where = {} if save_dir is None else {"save_dir": save_dir}  # the state's own prefix
    with CheckpointManager(root, streams=policies(), **where) as mgr:
        problems = [f"check: {p}" for p in mgr.check(load=True)]
        rows = ledger_rows(root)
        problems += ref.compare(rows)
        problems += ref.check_contents(mgr.save_dir, rows)
    odd = sorted({r.state for r in rows} - HEALTHY_STATES)
    return problems + ([f"rows left in states {odd} after reconcile"] if odd else [])


class Explorer:
    """Explores one trace under one persistence model (see the module docstring).

    ``stop_at_first`` ends at the first violation (a mutation check), and
    ``backward`` visits the cuts from the last one (where a mutation that
    loses an acknowledged save shows first). ``leftovers``: what the recording
    itself left in the object store, run closed, no cut, nothing reopened
    (:func:`.objects.store_problems`): each is a violation of that state.
    """

    def __init__(
        self,
        scenario: str,
        trace: Trace,
        check: Check,
        model: PersistenceModel,
        budget: Budget,
        *,
        stop_at_first: bool = False,
        backward: bool = False,
        leftovers: list[str] | None = None,
    ) -> None:
        self.scenario, self.trace, self.check = scenario, trace, check
        self.model, self.budget = model, budget
        self.stop_at_first, self.backward = stop_at_first, backward
        self.leftovers = leftovers or []
        self._seen: set[tuple[str, int]] = set()

    def run(self) -> Exploration:
        started = time.monotonic()
        result = Exploration(self.scenario, self.model.name, len(self.trace.ops))
        self._seen.clear()
        if self.leftovers:
            state = "no power cut: the store as the recording left it (run closed, not reopened)"
            result.violations.append(Violation(state, self.leftovers))
        self._explore_end(result)
        prefixes = range(len(self.trace.ops) + 1)
        for prefix in reversed(prefixes) if self.backward else prefixes:
            self._explore_cut(prefix, result)
            if result.violations and self.stop_at_first:
                break
        result.seconds = time.monotonic() - started
        return result

    def _explore_end(self, result: Exploration) -> None:
        """No power cut: every op of the recording on disk. Besides the scenario's check,
        the run must be clean as it stands: no temporary of the library left, and
        nothing for the reopen to repair (a file quarantined, one put back or removed)."""
        prefix = len(self.trace.ops)
        space = self.model.space(self.trace, prefix)
        state = CrashState(
            prefix, frozenset(space.floating), tuple((i, c[-1]) for i, c in space.partial)
        )
        tree = persisted_tree(self.trace, space, state)
        store = persisted_store(self.trace, space, state)
        before = {rel for rel in tree if not Path(rel).name.startswith(BOOKKEEPING)}
        problems = [f"a temporary of the library left: {rel}" for rel in temporaries(before)]
        problems += self._check(tree, store, state, len(marks_of(self.trace)))
        after = run_entries(self.trace.world)
        problems += [f"the reopen removed or moved {rel}" for rel in sorted(before - after)]
        problems += [f"the reopen made {rel}" for rel in sorted(after - before)]
        if problems:
            what = "no power cut: every op of the recording on disk, the run reopened"
            result.violations.append(Violation(what, problems))

    def _explore_cut(self, prefix: int, result: Exploration) -> None:
        """Every chosen state of one cut not seen before: checked, violations kept."""
        marks = sum(1 for op in self.trace.ops[:prefix] if op.mark is not None)
        result.crash_points += 1
        space = self.model.space(self.trace, prefix)
        for state in crash_states(space, self.budget):
            result.generated += 1
            tree = persisted_tree(self.trace, space, state)
            store = persisted_store(self.trace, space, state)
            key = (state_key(tree, store.digest_parts(self.trace)), marks)
            if key in self._seen:
                continue
            self._seen.add(key)
            result.explored += 1
            problems = self._check(tree, store, state, marks)
            if problems:
                result.violations.append(Violation(describe(self.trace, space, state), problems))
                if self.stop_at_first:
                    return

    def _check(
        self, tree: dict[str, Entry], store: StoreState, state: CrashState, marks: int
    ) -> list[str]:
        materialize(self.trace, tree)
        save_dir = None
        if self.trace.store is not None:  # a fresh prefix for each state
            save_dir = materialize_store(self.trace, store, len(self._seen))
        records = marks_of(self.trace)[:marks]
        return self.check(self.trace.root, records, save_dir)


def marks_of(trace: Trace) -> list[Mapping[str, Any]]:
    return [op.mark for op in trace.ops if op.mark is not None]


#: The run's own bookkeeping files, which every open rewrites.
BOOKKEEPING = ("ckptdb.sqlite", "ckptdb.lock", "ckptdb.owner")
#: What the library names its temporaries (a stream's file or directory being written,
#: an alias being swapped, the lock's owner record being replaced).
TEMPORARY = re.compile(
    r"(^|/)(\..*\.tmp-\d+|.*\.dcp\.tmp-.*|\..*\.ckptdb-(alias|old)|\.ckptdb\.owner\..*)$"
)


def run_entries(world: Path) -> set[str]:
    """Every entry under the world, but the run's bookkeeping files."""
    found = set()
    for path in world.rglob("*"):
        rel = path.relative_to(world).as_posix()
        if not path.name.startswith(BOOKKEEPING):
            found.add(rel)
    return found


def temporaries(entries: Iterable[str]) -> list[str]:
    return sorted(rel for rel in entries if TEMPORARY.search(rel))


# ------------------------------------------------------------------ states


@dataclass(frozen=True)
class Symlink:
    """A symbolic link in a crash state's tree."""

    target: str


Entry = bytes | Symlink | None  # a file's bytes, a symbolic link, a directory


def persisted_tree(trace: Trace, space: CrashSpace, state: CrashState) -> dict[str, Entry]:
    """The files (their bytes), links and directories (None) a crash state leaves, by name."""
    entries = {d: dict(trace.base.get(d, {})) for d in trace.directories}
    counts = {ino: len(steps) for ino, steps in space.pieces.items()}
    counts.update(state.counts)
    for op in trace.ops[: state.prefix]:
        if not op.effects or (op.index not in space.pinned and op.index not in state.kept):
            continue
        for effect in op.effects:
            if effect.ino is None:
                entries[effect.directory].pop(effect.name, None)
            else:
                entries[effect.directory][effect.name] = effect.ino
        if op.index in space.floors:
            ino, n = space.floors[op.index]
            counts[ino] = max(counts.get(ino, 0), n)
    tree: dict[str, Entry] = {}

    def walk(directory: int, prefix: str, above: frozenset[int]) -> None:
        for name, ino in sorted(entries[directory].items()):
            rel = f"{prefix}{name}"
            if ino in trace.directories:
                if ino not in above:  # a directory never holds itself, even half-renamed
                    tree[rel] = None
                    walk(ino, rel + "/", above | {ino})
            elif ino in trace.links:
                tree[rel] = Symlink(trace.links[ino])
            else:  # what it held at the start, and the pieces of the prefix that persisted
                steps = space.pieces.get(ino, ())
                tree[rel] = apply(trace.base_files.get(ino, b""), steps[: counts.get(ino, 0)])

    walk(WORLD, "", frozenset({WORLD}))
    return tree


def state_key(tree: dict[str, Entry], store: Iterable[bytes] = ()) -> str:
    """What identifies a state: each entry's name and content (of :data:`OPAQUE` files,
    the name only), the ledger by what SQLite recovers from its files (two WALs cut
    at different frames of one uncommitted transaction are one state), and the object
    store's state."""
    digest = xxhash.xxh3_128()
    ledgers = {rel for rel in tree if rel.endswith(LEDGER_SUFFIXES)}
    for rel, content in sorted(tree.items()):
        if rel in ledgers:
            continue
        digest.update(rel.encode() + b"\0")
        if rel.endswith(OPAQUE):  # only its being there can matter
            digest.update(b"o")
        elif content is None:
            digest.update(b"d")
        elif isinstance(content, Symlink):
            digest.update(b"l" + content.target.encode())
        else:
            digest.update(xxhash.xxh3_128_digest(content))
    for rel in sorted(rel for rel in ledgers if rel.endswith(LEDGER_FILE)):
        database, wal, journal = (tree.get(f"{rel}{end}") for end in ("", "-wal", "-journal"))
        if isinstance(database, bytes):
            sidecars = tuple(f if isinstance(f, bytes) else None for f in (wal, journal))
            digest.update(rel.encode() + b"\0" + recovered_ledger(database, *sidecars))
    for part in store:  # the object store's state (the blob's index names its bytes)
        digest.update(b"\0" + part)
    return digest.hexdigest()


LEDGER_SUFFIXES = (LEDGER_FILE, f"{LEDGER_FILE}-wal", f"{LEDGER_FILE}-journal")
#: Files whose content nothing decides by: the lock file (empty, locked with flock) and
#: the writer's owner record (shown in the "locked by" message, read leniently). States
#: that differ only in how much of them reached the disk are one state.
OPAQUE = ("ckptdb.lock", "ckptdb.owner")


@functools.lru_cache(maxsize=4096)
def recovered_ledger(database: bytes, wal: bytes | None, journal: bytes | None) -> bytes:
    """The digest of what SQLite makes of a database file with its WAL and journal
    (recovery run in a scratch directory), or of the raw bytes where it cannot open them."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / LEDGER_FILE
        path.write_bytes(database)
        for end, content in (("-wal", wal), ("-journal", journal)):
            if content is not None:
                Path(f"{path}{end}").write_bytes(content)
        try:
            recovered = snapshot_ledger(path)
        except sqlite3.DatabaseError:
            recovered = b"\0".join((b"unreadable", database, wal or b"", journal or b""))
    return xxhash.xxh3_128_digest(recovered)


def snapshot_ledger(database: Path) -> bytes:
    """The committed content of a SQLite database, read through SQLite's backup API."""
    source = sqlite3.connect(database)
    target = sqlite3.connect(":memory:")
    try:
        source.backup(target)
        return target.serialize()
    finally:
        source.close()
        target.close()


def materialize(trace: Trace, tree: dict[str, Entry]) -> None:
    """Make the world directory hold exactly ``tree`` (the ledger's files included)."""
    shutil.rmtree(trace.world, ignore_errors=True)
    trace.world.mkdir(parents=True)
    for rel, content in sorted(tree.items()):
        path = trace.world / rel
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
        elif isinstance(content, Symlink):
            os.symlink(content.target, path)
        else:
            path.write_bytes(content)


def describe(trace: Trace, space: CrashSpace, state: CrashState, limit: int = 6) -> str:
    """A crash state in words: where the cut is, what did not reach the disk."""
    ops = trace.ops
    cut = (
        f"power cut after op {state.prefix} of {len(ops)} ({ops[state.prefix - 1].text})"
        if state.prefix
        else "power cut before the first op"
    )
    lost = [ops[i] for i in space.floating if i not in state.kept]
    done = [ops[i] for i in sorted(state.kept) if ops[i].kind in S3_REQUESTS]
    parts = [cut]
    groups = (
        ("not on disk", [op.text for op in lost if op.kind not in S3_REQUESTS]),
        ("sent, not in effect", [op.text for op in lost if op.kind in S3_REQUESTS]),
        ("sent, in effect", [op.text for op in done]),
    )
    for what, texts in groups:
        if texts:
            more = f", +{len(texts) - limit} more" if len(texts) > limit else ""
            parts.append(f"{what}: " + "; ".join(texts[:limit]) + more)
    short = []
    for ino, n in state.counts:
        steps = space.pieces[ino]
        if n < len(steps):
            unsynced = {p.op for p in steps[n:]}
            missing = sum(len(p.data or b"") for p in steps[n:])
            short.append(
                f"{trace.names.get(ino, ino)}: {missing} bytes of {len(unsynced)} write(s) "
                f"after its last fsync lost"
            )
    if short:
        parts.append("data not on disk: " + "; ".join(short))
    return "; ".join(parts)
