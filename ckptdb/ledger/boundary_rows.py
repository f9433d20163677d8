"""The boundary's statements, run at the driver level: the hot path of every save.

Why not the ORM here: a 3-stream boundary ran 36 SQLAlchemy statements, and
building them (statement objects, cache keys, unit-of-work flushes, loading
rows into objects) cost ~10 ms, some 40 fsyncs' worth. Each statement here is
plain SQL written once, rendered once per driver parameter style, and run on
the driver's cursor (:mod:`~ckptdb.ledger.driver`); a list of parameter tuples
is one driver ``executemany`` (one call for all the streams of a boundary). Errors still surface as
SQLAlchemy's, so :meth:`Ledger.transaction` translates them like any other, and the
statements run inside the caller's transaction, like every helper of
:mod:`~ckptdb.ledger.rows`.

Nothing is cached between transactions: the ledger stays the only truth, so a
rolled-back boundary, a reconcile or another process's change is simply read
by the next one. The rest of the ledger (open, reconcile, queries) keeps the
ORM, where readability matters more than microseconds.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import text
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.orm import Session

from ..errors import LedgerError
from ..policies import Entry, Reads
from . import models as m
from .driver import Executed, execute
from .held import connection_of
from .rows import LIVE_STATES, latest_pointer

Params = tuple[Any, ...]
T = TypeVar("T")

#: The most values one statement binds: under the 999 of old SQLite builds (newer ones
#: allow 32766, psycopg 65535). A long list (a large eviction's pin check, a boundary of
#: many streams) goes in batches, else a driver error would fail every save from then on.
MAX_BOUND = 900

#: Parameter styles whose placeholders are positional (the driver takes tuples).
_POSITIONAL = {"qmark": "?", "format": "%s", "pyformat": "%s"}


@dataclass(frozen=True)
class Member:
    """A committed row as admission, retention and the clean-up see it."""

    id: int
    step: int
    metric: float | None
    path: str

    @property
    def entry(self) -> Entry:
        return Entry(id=self.id, step=self.step, metric=self.metric)


def entries(members: Iterable[Member]) -> list[Entry]:
    return [member.entry for member in members]


@functools.lru_cache(maxsize=256)
def _rendered(sql: str, paramstyle: str) -> str:
    """``sql`` (written with ``?`` placeholders and no literal ``%`` or ``?``) in the
    driver's style; a named or numeric style gets ``:p0``, ``:p1``... (see :func:`run`)."""
    marker = _POSITIONAL.get(paramstyle)
    if marker == "%s":
        return sql.replace("%", "%%").replace("?", "%s")
    if marker is not None:
        return sql
    parts = sql.split("?")
    return parts[0] + "".join(f":p{i}{part}" for i, part in enumerate(parts[1:]))


def run(session: Session, sql: str, params: Params | list[Params] = ()) -> Executed:
    """Run ``sql`` with one tuple of parameters, or a list of them (one executemany)."""
    connection = connection_of(session)
    dialect = connection.dialect
    rendered = _rendered(sql, dialect.paramstyle)
    if dialect.paramstyle in _POSITIONAL:
        return execute(connection, rendered, params)
    return _run_named(connection, rendered, params)


def fetch(session: Session, sql: str, params: Params) -> list[tuple[Any, ...]]:
    """The rows ``sql`` returns (a query, or a statement with ``RETURNING``)."""
    return run(session, sql, params).rows


def _run_named(connection: Connection, sql: str, params: Params | list[Params]) -> Executed:
    """Another backend's driver (named parameters): the same SQL through ``text()``."""

    def named(values: Params) -> dict[str, Any]:
        return {f"p{i}": v for i, v in enumerate(values)}

    many = [named(p) for p in params] if isinstance(params, list) else named(params)
    result = connection.execute(text(sql), many)
    if not result.returns_rows:
        return Executed([], getattr(result, "lastrowid", None))
    types = tuple(column[1] for column in result.cursor.description)
    return Executed([tuple(row) for row in result], None, types)


@functools.lru_cache(maxsize=8)
def _stamp_processor(dialect: Dialect) -> Callable[[Any], Any]:
    processor = m.UTCDateTime().dialect_impl(dialect).bind_processor(dialect)
    return processor if processor is not None else (lambda value: value)


def stamp(session: Session, when: dt.datetime) -> Any:
    """``when`` as the driver stores a :class:`~ckptdb.ledger.models.UTCDateTime`
    (naive UTC; on SQLite the same text SQLAlchemy writes, so comparisons hold)."""
    return _stamp_processor(connection_of(session).dialect)(when)


# --------------------------------------------------------------------- intent

_INSERT = (
    "INSERT INTO checkpoints (run_id, stream, step, attempt_id, path, state, metric, metrics,"
    " created_at, world_size, topology, saving_before_s)"
)
_INSERT_ROW = "(?, ?, ?, ?, '', ?, ?, ?, ?, ?, ?, ?)"


def add_pending(
    session: Session,
    run_id: int,
    attempt_id: int,
    step: int,
    metrics: dict[str, float],
    metric_of: dict[str, float | None],
    world_size: int,
    topology_of: dict[str, str | None],
    saving_before: float | None = None,
) -> dict[str, int]:
    """Insert one ``pending`` row per stream of ``metric_of`` (its ranking value) in one
    statement (one per :data:`MAX_BOUND` values: a boundary of very many streams); their
    ids by stream (a boundary has each stream at most once). Each row records the
    ``world_size`` that saves it, its stream's ``topology_of`` (JSON, or None) and
    ``saving_before``, the attempt's blocked seconds so far (goodput)."""
    if not metric_of:
        return {}
    encoded = json.dumps(metrics) if metrics else None
    now = stamp(session, m.utcnow())
    rows = [
        (
            run_id,
            stream,
            step,
            attempt_id,
            m.PENDING,
            metric,
            encoded,
            now,
            world_size,
            topology_of.get(stream),
            saving_before,
        )
        for stream, metric in metric_of.items()
    ]
    if not connection_of(session).dialect.insert_returning:
        return _add_one_by_one(session, rows)
    ids: dict[str, int] = {}
    for part in batches(rows, MAX_BOUND // len(rows[0])):
        found = fetch(
            session,
            f"{_INSERT} VALUES {', '.join([_INSERT_ROW] * len(part))} RETURNING id, stream",
            tuple(value for row in part for value in row),
        )
        # RETURNING's row order is unspecified (SQLite, PostgreSQL): matched by stream
        ids.update((stream, int(row_id)) for row_id, stream in found)
    assert ids.keys() == metric_of.keys(), "one id per inserted stream"
    return ids


def _add_one_by_one(session: Session, rows: list[Params]) -> dict[str, int]:
    """SQLite before 3.35 (Debian 11, Ubuntu 20.04) has no ``RETURNING``: one INSERT per
    stream, its id the driver's ``lastrowid`` (what the ORM did on such a build)."""
    return {
        row[1]: _inserted_id(run(session, f"{_INSERT} VALUES {_INSERT_ROW}", row)) for row in rows
    }


def _inserted_id(result: Executed) -> int:
    if result.lastrowid is None:  # a driver that cannot say: never guess an id
        raise LedgerError("the database driver did not report the id of an inserted row")
    return int(result.lastrowid)


def newest_attempt(session: Session, run_id: int, *, lock: bool) -> int | None:
    """The run's newest attempt; with ``lock``, the run's row is locked until COMMIT.

    The fence every commit checks (with ``lock``): a writer commits only while
    its attempt is the run's newest. A writer that opens the run takes the same
    row lock to add its attempt (:func:`ckptdb.ledger.rows.start_attempt`), so an
    open and a commit never interleave: the commit either lands before the open
    (whose reconcile then sees it committed) or sees the newer attempt and stops.
    One statement. The lock is ``FOR NO KEY UPDATE``: it conflicts with another
    such lock (an open adding its attempt), never with the key-share locks that
    foreign keys take (a reader inserting a pin or an evaluation while holding a
    checkpoint's row), which would deadlock with the commit's own updates.
    SQLite needs no row lock: its writers are serialized by the database file's
    own lock.
    """
    newest = "(SELECT MAX(a.id) FROM attempts a WHERE a.run_id = r.id)"
    locked = lock and connection_of(session).dialect.name == "postgresql"
    sql = f"SELECT {newest} FROM runs r WHERE r.id = ?"
    if locked:
        sql += " FOR NO KEY UPDATE OF r"
    ((found,),) = fetch(session, sql, (run_id,))
    return int(found) if found is not None else None


def states_of(session: Session, ids: Sequence[int]) -> dict[int, str]:
    """Each row's state (a boundary whose COMMIT's answer was lost, read back)."""
    found: dict[int, str] = {}
    for batch in batches(ids, MAX_BOUND):
        rows = fetch(
            session,
            f"SELECT id, state FROM checkpoints WHERE id IN ({_marks(len(batch))})",
            tuple(batch),
        )
        found.update({int(i): str(state) for i, state in rows})
    return found


def live_paths(session: Session, run_id: int, step: int, streams: Sequence[str]) -> set[str]:
    """Paths that live rows of ``streams`` at ``step`` hold: where a name in ckptdb's own
    naming (which only its stream and step can use) is taken. One indexed read for the
    whole boundary (batched as :data:`MAX_BOUND` requires), through
    ``(run_id, stream, state, step)``."""
    paths: set[str] = set()
    if not streams:
        return paths
    for part in batches(streams, MAX_BOUND - 2 - len(LIVE_STATES)):
        found = fetch(
            session,
            "SELECT path FROM checkpoints WHERE run_id = ? AND step = ?"
            f" AND stream IN ({_marks(len(part))}) AND state IN ({_marks(len(LIVE_STATES))})",
            (run_id, step, *part, *LIVE_STATES),
        )
        paths.update(str(path) for (path,) in found)
    return paths


def set_paths(session: Session, named: Sequence[tuple[int, str, str]]) -> None:
    """Record each (row id, final path, temporary path) of the intent (one executemany)."""
    if named:
        rows = [(path, tmp, row_id) for row_id, path, tmp in named]
        run(session, "UPDATE checkpoints SET path = ?, tmp_path = ? WHERE id = ?", rows)


# --------------------------------------------------------------------- commit


def mark_committed(
    session: Session, written: Sequence[tuple[int, int, str]], now: dt.datetime
) -> None:
    """Each (row id, size, hash): ``committed`` at ``now``, its temporary name gone."""
    if written:
        at = stamp(session, now)
        rows = [(m.COMMITTED, size, hash_, at, row_id) for row_id, size, hash_ in written]
        run(
            session,
            "UPDATE checkpoints SET state = ?, size = ?, hash = ?, committed_at = ?,"
            " tmp_path = NULL WHERE id = ?",
            rows,
        )


def mark_evicted(session: Session, ids: Sequence[int], now: dt.datetime) -> None:
    """Rows retention evicted: ``deleting`` since ``now`` (the file goes after COMMIT)."""
    if ids:
        at = stamp(session, now)
        rows = [(m.DELETING, at, row_id) for row_id in ids]
        run(session, "UPDATE checkpoints SET state = ?, deleted_at = ? WHERE id = ?", rows)


def mark_deleted(session: Session, ids: Sequence[int]) -> None:
    """Rows whose evicted files are gone (the clean-up after a commit)."""
    if ids:
        run(session, "UPDATE checkpoints SET state = ? WHERE id = ?", [(m.DELETED, i) for i in ids])


def point_latest(session: Session, run_id: int, latest: Sequence[tuple[str, int]]) -> None:
    """Move each ``latest:<stream>`` pointer (created if absent) in one executemany."""
    if latest:
        rows = [(run_id, latest_pointer(stream), row_id) for stream, row_id in latest]
        run(
            session,
            "INSERT INTO pointers (run_id, name, checkpoint_id) VALUES (?, ?, ?)"
            " ON CONFLICT (run_id, name) DO UPDATE SET checkpoint_id = excluded.checkpoint_id",
            rows,
        )


def pinned_ids(
    session: Session, run_id: int, ids: Sequence[int], now: dt.datetime
) -> tuple[set[int], bool]:
    """Which of ``ids`` have a live pin (unreleased, not expired): what
    :func:`ckptdb.ledger.pins.pinned_ids` answers, in one driver statement (one per
    :data:`MAX_BOUND` ids: a large eviction); and whether the run has a registered
    tier (:mod:`~ckptdb.ledger.tiers`: its evictions may wait for copies), asked in
    the same statement, so a run without one pays nothing for the feature."""
    held: set[int] = set()
    tiered = False
    if not ids:
        return held, tiered
    at = stamp(session, now)
    for number, part in enumerate(batches(ids, MAX_BOUND - 3)):
        sql = (
            "SELECT checkpoint_id FROM pins WHERE run_id = ?"
            f" AND checkpoint_id IN ({_marks(len(part))})"
            " AND released_at IS NULL AND expires_at > ?"
        )
        params: Params = (run_id, *part, at)
        if number == 0:  # a checkpoint id is positive: -1 says "a tier is registered"
            sql += " UNION ALL SELECT -1 FROM tiers WHERE run_id = ?"
            params = (*params, run_id)
        for (i,) in fetch(session, sql, params):
            if int(i) < 0:
                tiered = True
            else:
                held.add(int(i))
    return held, tiered


# ------------------------------------------------------------------- members

_MEMBERS = (
    "SELECT id, step, metric, path FROM checkpoints WHERE run_id = ? AND stream = ? AND state = ?"
)


def committed_members(
    session: Session, run_id: int, stream: str, reads: Reads | None = None, step: int = 0
) -> list[Member]:
    """A stream's committed rows, all of them (``reads`` None or ``everything``) or those
    ``reads`` selects for a commit at ``step`` (see :class:`~ckptdb.policies.Reads`),
    ordered by step and id: what :func:`ckptdb.ledger.rows.committed_entries` returns."""
    key = (run_id, stream, m.COMMITTED)
    if reads is None or reads.everything:
        return _members(session, _MEMBERS + " ORDER BY step, id", key)
    chosen = {r.id: r for r in _members(session, _MEMBERS + " AND step >= ?", (*key, step))}
    if reads.newest_below:
        newest = _MEMBERS + " AND step < ? ORDER BY step DESC, id DESC LIMIT ?"
        chosen.update(
            (r.id, r) for r in _members(session, newest, (*key, step, reads.newest_below))
        )
    if reads.not_multiple_of is not None:
        odd = _MEMBERS + " AND step % ? != 0"
        chosen.update((r.id, r) for r in _members(session, odd, (*key, reads.not_multiple_of)))
    return sorted(chosen.values(), key=lambda r: (r.step, r.id))


def committed_paths(session: Session, run_id: int) -> list[tuple[str, str]]:
    """(stream, path) of every committed row of the run: read only when a directory
    the save needs is not there (see :mod:`ckptdb.protocol.absence`)."""
    sql = "SELECT stream, path FROM checkpoints WHERE run_id = ? AND state = ?"
    return [(str(s), str(p)) for s, p in fetch(session, sql, (run_id, m.COMMITTED))]


def _members(session: Session, sql: str, params: Params) -> list[Member]:
    return [
        Member(int(i), int(s), None if v is None else float(v), str(p))
        for i, s, v, p in fetch(session, sql, params)
    ]


def _marks(count: int) -> str:
    return ", ".join(["?"] * count)


def batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size`` (see :data:`MAX_BOUND`)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
