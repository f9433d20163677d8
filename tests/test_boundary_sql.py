"""The boundary's driver-level statements (ckptdb/ledger/boundary_rows.py).

A statement count is deterministic (unlike time), so the hot path's cost is
pinned by counting: a steady-state boundary may not run more statements or
transactions than it does now. The driver statements must also read and
write exactly what the ORM would: the same rows for every retention read,
the same timestamp text, on SQLite and PostgreSQL, and in every driver
parameter style.
"""

from __future__ import annotations

import re
import sqlite3
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import LedgerClient, pg_admin, state, value_of
from sqlalchemy import create_engine, event
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ckptdb import CheckpointManager, Keep, TopK
from ckptdb.errors import DatabaseError, LedgerError
from ckptdb.ledger import boundary_rows, driver, pins, tiers
from ckptdb.ledger import models as m
from ckptdb.ledger import rows as ledger_rows
from ckptdb.ledger.boundary_rows import _rendered
from ckptdb.ledger.driver import Executed
from ckptdb.policies import Reads

Opener = Callable[..., CheckpointManager]
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)

#: Statements of a steady-state 3-stream boundary, every stream evicting. SQLite:
#: intent 7 (PRAGMA, BEGIN, the writer fence, top-K members, INSERT ... RETURNING,
#: taken names, names), commit 10 (PRAGMA, BEGIN, the writer fence, committed, 3
#: retention reads, evicted, pins, pointers) + metrics, clean-up 2 (BEGIN,
#: deleted: its level is the intent's, so no PRAGMA). PostgreSQL: no PRAGMA and
#: no BEGIN statement (the driver begins implicitly), but one pg_notify for
#: followers. The fence is one statement each time (the commit's locks the run's row).
STEADY_STATEMENTS = {"sqlite": 20, "postgresql": 16}
STREAMS = {"model": Keep(last=2), "best": TopK(2, "loss"), "ema": Keep(last=1)}


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    """Runs opened here (``open_manager``, ``db``) use both ledgers in turn."""
    return backend


@pytest.fixture
def counted(backend: str | None, open_manager: Opener) -> Iterator[tuple[CheckpointManager, dict]]:
    """A 3-stream run past its warm-up (every stream full), with statement and
    transaction counters on its engine."""
    mgr = open_manager(db_url=backend, streams=dict(STREAMS))
    for step in range(4):
        mgr.save(step, metrics={"loss": float(-step)}, **{s: state(step) for s in STREAMS})
    counts: dict[str, Any] = {"statements": [], "begins": 0}
    engine = mgr._ctx.ledger.engine

    def on_statement(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        counts["statements"].append(statement.split()[0].upper())

    def on_begin(_conn: Any) -> None:
        counts["begins"] += 1

    event.listen(engine, "before_cursor_execute", on_statement)
    event.listen(engine, "begin", on_begin)
    yield mgr, counts
    event.remove(engine, "before_cursor_execute", on_statement)
    event.remove(engine, "begin", on_begin)


def test_a_steady_boundary_runs_a_fixed_number_of_statements(
    counted: tuple[CheckpointManager, dict], db: LedgerClient
) -> None:
    mgr, counts = counted
    mgr.log_metrics(9, {"lr": 0.1})
    saved = mgr.save(10, metrics={"loss": -10.0}, **{s: state(10) for s in STREAMS})
    backend = mgr._ctx.ledger.backend
    assert len(counts["statements"]) == STEADY_STATEMENTS[backend], counts["statements"]
    assert counts["begins"] == 3  # intent, commit, clean-up
    # the one multi-row INSERT ... RETURNING gave every stream its own row
    for stream, record in saved.items():
        found = db.rows(
            "SELECT stream, step, state, path, tmp_path FROM checkpoints WHERE id = ?", record.id
        )
        assert found == [(stream, 10, "committed", f"{stream}/step-000000010.pt", None)]
    # and every stream evicted at this boundary, its file gone, its row deleted
    live = db.rows("SELECT stream, step FROM checkpoints WHERE state = 'committed' ORDER BY 1, 2")
    assert live == [("best", 3), ("best", 10), ("ema", 10), ("model", 3), ("model", 10)]
    assert len(db.rows("SELECT id FROM checkpoints WHERE state = 'deleting'")) == 0
    # the eviction recorded when it happened: in the commit, after the new rows' commit time
    evicted = db.rows(
        "SELECT stream, step, deleted_at FROM checkpoints WHERE state = 'deleted' "
        "AND deleted_at >= (SELECT MAX(committed_at) FROM checkpoints WHERE step = 10) "
        "ORDER BY 1, 2"
    )
    assert [(s, step) for s, step, _ in evicted] == [("best", 2), ("ema", 3), ("model", 2)]


def test_a_boundary_that_admits_nothing_still_reads_only_its_members(
    counted: tuple[CheckpointManager, dict],
) -> None:
    """A top-K candidate that would not enter: one read transaction, no insert."""
    mgr, counts = counted
    assert mgr.save(10, metrics={"loss": 99.0}, best=state(10)) == {}
    assert "INSERT" not in counts["statements"]
    assert counts["begins"] == 1


def test_a_name_a_live_row_holds_is_not_reused_even_without_its_file(
    backend: str | None, open_manager: Opener, db: LedgerClient
) -> None:
    """A row that still owns its name (here ``lost``: its file is gone) keeps it: a new
    save of that step is versioned, found by the one read of taken names."""
    mgr = open_manager(db_url=backend, streams={"model": Keep(last=None)})
    first = mgr.save(5, model=state(5))["model"]
    first.path.unlink()
    db.execute("UPDATE checkpoints SET state = 'lost' WHERE id = ?", first.id)
    again = mgr.save(5, model=state(6))["model"]
    assert again.path != first.path and again.path.exists()
    assert db.rows("SELECT state, path FROM checkpoints ORDER BY id") == [
        ("lost", "model/step-000000005.pt"),
        ("committed", str(again.path.relative_to(again.path.parent.parent))),
    ]


@pytest.mark.parametrize(
    "reads",
    [
        None,
        Reads(everything=True),
        Reads(),
        Reads(newest_below=2),
        Reads(not_multiple_of=3),
        Reads(newest_below=3, not_multiple_of=4),
    ],
    ids=repr,
)
def test_retention_reads_match_the_orm_reads(
    backend: str | None, open_manager: Opener, db: LedgerClient, reads: Reads | None
) -> None:
    """The driver read returns the rows (and order) the ORM read returns, for every
    kind of read retention makes (the modulo also through PostgreSQL's ``%s`` style)."""
    mgr = open_manager(db_url=backend, streams={"model": Keep(last=None)})
    for step in range(12):
        mgr.save(step, metrics={"loss": float(step % 5)}, model=state(step))
    db.execute("UPDATE checkpoints SET state = 'deleted' WHERE step IN (4, 7)")
    db.execute("UPDATE checkpoints SET metric = NULL WHERE step = 5")
    db.execute("UPDATE checkpoints SET metric = 2.5 WHERE step = 6")
    ctx = mgr._ctx
    seen = 0
    for at in (0, 6, 11, 30):
        with ctx.ledger.transaction(read=True) as session:
            found, entries = ledger_rows.committed_entries(
                session, ctx.run_id, "model", reads=reads, step=at
            )
            fast = boundary_rows.committed_members(
                session, ctx.run_id, "model", reads, at if reads is not None else 0
            )
        assert [(r.id, r.step, r.metric, r.path) for r in found] == [
            (r.id, r.step, r.metric, r.path) for r in fast
        ]
        assert boundary_rows.entries(fast) == entries
        seen += len(fast)
    assert seen, "the comparison saw rows"


@SQLITE_ONLY
def test_the_driver_writes_timestamps_as_the_orm_does(open_manager: Opener, root: Any) -> None:
    """SQLite compares timestamps as text: the driver's must be the ORM's format, or a
    pin's expiry and the eviction time would compare wrongly."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    first = mgr.save(1, model=state(1))["model"]
    second = mgr.save(2, model=state(2))["model"]
    client = LedgerClient(root)
    try:
        (orm_written,) = client.rows("SELECT started_at FROM attempts")[0]
        stamps = client.rows(
            "SELECT created_at, committed_at, deleted_at FROM checkpoints WHERE id = ?", first.id
        )[0]
    finally:
        client.close()
    form = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}$")
    assert form.match(orm_written)
    assert all(form.match(s) for s in stamps), stamps
    listed = {c.id: c for c in mgr.checkpoints(states=("committed", "deleted"))}
    assert listed[second.id].committed_at == second.committed_at  # read back aware, exact


def test_statements_render_for_every_parameter_style() -> None:
    sql = "SELECT id FROM t WHERE a = ? AND b % ? = 0"
    assert _rendered(sql, "qmark") == sql
    assert _rendered(sql, "format") == "SELECT id FROM t WHERE a = %s AND b %% %s = 0"
    assert _rendered(sql, "pyformat") == "SELECT id FROM t WHERE a = %s AND b %% %s = 0"
    assert _rendered(sql, "named") == "SELECT id FROM t WHERE a = :p0 AND b % :p1 = 0"


def test_a_named_parameter_driver_runs_the_same_statements() -> None:
    """A driver with named parameters (pysqlite can be one) goes through ``text()``:
    one tuple, a list of tuples (executemany) and RETURNING all work."""
    engine = create_engine("sqlite://", paramstyle="named")
    assert engine.dialect.paramstyle == "named"
    with Session(engine) as session, session.begin():
        session.connection().exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, b INT)")
        boundary_rows.run(session, "INSERT INTO t (b) VALUES (?)", [(3,), (4,), (6,)])
        got = boundary_rows.fetch(session, "INSERT INTO t (b) VALUES (?) RETURNING id, b", (9,))
        assert got == [(4, 9)]
        odd = boundary_rows.fetch(session, "SELECT b FROM t WHERE b % ? != 0 ORDER BY b", (3,))
        assert odd == [(4,)]


@SQLITE_ONLY
def test_synchronous_is_set_only_when_the_level_changes(open_manager: Opener) -> None:
    """Each transaction still runs at its own level (FULL when durable), but the PRAGMA
    runs only on a change, and a new connection starts from FULL again."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    ledger = mgr._ctx.ledger
    levels: list[int] = []
    pragmas: list[str] = []

    def on_begin(connection: Any) -> None:
        levels.append(connection.exec_driver_sql("PRAGMA synchronous").scalar())

    def on_statement(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if statement.startswith("PRAGMA synchronous ="):
            pragmas.append(statement)

    event.listen(ledger.engine, "begin", on_begin)
    event.listen(ledger.engine, "before_cursor_execute", on_statement)
    ledger.dispose()  # a fresh connection: FULL from the connect hook
    for durable in (True, True, False, False, True, False):
        with ledger.transaction(durable=durable) as session:
            session.connection()  # begins
    ledger.dispose()  # the held writer connection too: the next one is new
    with ledger.transaction(durable=False) as session:
        session.connection()
    event.remove(ledger.engine, "begin", on_begin)
    event.remove(ledger.engine, "before_cursor_execute", on_statement)
    assert levels == [2, 2, 1, 1, 2, 1, 1]  # FULL = 2, NORMAL = 1
    assert pragmas == [
        "PRAGMA synchronous = NORMAL",
        "PRAGMA synchronous = FULL",
        "PRAGMA synchronous = NORMAL",
        "PRAGMA synchronous = NORMAL",  # the new connection's
    ]


@SQLITE_ONLY
def test_a_failed_pragma_leaves_the_level_unknown_and_the_next_transaction_sets_it(
    open_manager: Opener,
) -> None:
    """The remembered level is only what the connection really has: a PRAGMA that failed
    is issued again, so a durable commit never runs at NORMAL."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    ledger = mgr._ctx.ledger
    ledger.dispose()  # from here on the pool holds one connection, the held one
    with ledger.transaction(durable=False) as session:
        session.connection()  # the connection is at NORMAL now
        first = session.connection().connection.dbapi_connection
    failed: list[str] = []
    levels: list[int] = []
    pragmas: list[tuple[str, Any]] = []

    def fail_once(_c: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith("PRAGMA synchronous ="):
            pragmas.append((statement, cursor.connection))
        if statement == "PRAGMA synchronous = FULL" and not failed:
            failed.append(statement)
            raise sqlite3.OperationalError("disk I/O error")

    def on_begin(connection: Any) -> None:
        levels.append(connection.exec_driver_sql("PRAGMA synchronous").scalar())

    event.listen(ledger.engine, "before_cursor_execute", fail_once)
    try:
        with (
            pytest.raises(DatabaseError, match="disk I/O error"),
            ledger.transaction() as session,
        ):
            session.connection()
        event.listen(ledger.engine, "begin", on_begin)
        with ledger.transaction() as session:
            session.connection()
    finally:
        event.remove(ledger.engine, "before_cursor_execute", fail_once)
        event.remove(ledger.engine, "begin", on_begin)
    assert failed and levels == [2]  # FULL, on the same pooled connection
    assert pragmas == [("PRAGMA synchronous = FULL", first)] * 2  # issued again


#: Bound parameters a statement may carry on an old SQLite build (SQLITE_MAX_VARIABLE_NUMBER).
OLD_SQLITE_LIMIT = 999
#: More ids than one PostgreSQL statement may bind (psycopg: 65535).
MANY = 70_000


@pytest.fixture
def old_sqlite_limit(backend: str | None) -> Callable[[Any], None]:
    """Gives a run's SQLite connections an old build's parameter limit (999)."""

    def limit(engine: Any) -> None:
        if backend is None:
            engine.dispose()
            event.listen(engine, "connect", _limit_variables)

    return limit


def _limit_variables(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, OLD_SQLITE_LIMIT)


def test_a_large_eviction_checks_its_pins_within_the_parameter_limit(
    backend: str | None, open_manager: Opener, old_sqlite_limit: Callable[[Any], None]
) -> None:
    """A policy tightened on a long run evicts many rows in one commit: their pin check
    must not bind more parameters than the driver allows (or every save fails)."""
    mgr = open_manager(db_url=backend, streams={"model": Keep(last=None)})
    pinned = mgr.save(1, model=state(1))["model"]
    free = mgr.save(2, model=state(2))["model"]
    ctx = mgr._ctx
    old_sqlite_limit(ctx.ledger.engine)
    with ctx.ledger.transaction() as session:
        pins.add(session, ctx.run_id, pinned.id, "test", 600.0)
    ids = [free.id, *range(10**7, 10**7 + MANY), pinned.id]
    with ctx.ledger.transaction() as session:
        held, tiered = boundary_rows.pinned_ids(session, ctx.run_id, ids, m.utcnow())
    assert held == {pinned.id} and not tiered
    with ctx.ledger.transaction() as session:  # the ORM's check (gc, reconcile) too
        assert pins.pinned_ids(session, ctx.run_id, ids, m.utcnow()) == {pinned.id}
    with ctx.ledger.transaction() as session:  # a replicated run holds them for their copy
        tiers.register(session, ctx.run_id, "remote", "s3://b/p", None, {})
        assert boundary_rows.pinned_ids(session, ctx.run_id, ids, m.utcnow()) == (
            {pinned.id},
            True,
        )
        held = tiers.hold_for_copy(session, ctx.run_id, ids, m.utcnow())
        assert held == {free.id, pinned.id}
    with ctx.ledger.transaction() as session:
        pins.drop(session, ids)
    with ctx.ledger.transaction() as session:
        assert pins.pinned_ids(session, ctx.run_id, [pinned.id], m.utcnow()) == set()


@SQLITE_ONLY
def test_a_boundary_of_many_streams_stays_within_an_old_sqlite_parameter_limit(
    open_manager: Opener, old_sqlite_limit: Callable[[Any], None]
) -> None:
    """One INSERT for every stream of a boundary binds 8 values a stream: 130 streams
    would pass 999, so the rows go in batches; every id still matches its stream."""
    streams = {f"s{i}": Keep(last=1) for i in range(130)}
    mgr = open_manager(streams=dict(streams))
    old_sqlite_limit(mgr._ctx.ledger.engine)
    saved = mgr.save(1, **{s: state(i) for i, s in enumerate(streams)})
    for i, stream in enumerate(streams):
        assert saved[stream].stream == stream
        assert value_of(mgr.load(saved[stream])) == float(i)


@SQLITE_ONLY
def test_a_sqlite_without_returning_still_saves_every_stream(
    open_manager: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite before 3.35 (Debian 11, Ubuntu 20.04) has no RETURNING, and SQLAlchemy says
    so on its dialect: the pending rows then go in one by one, each id matched to its
    stream, and a boundary saves as anywhere else."""
    streams = {"model": Keep(last=1), "ema": Keep(last=1), "aux": Keep(last=1)}
    mgr = open_manager(streams=dict(streams))
    engine = mgr._ctx.ledger.engine
    monkeypatch.setattr(engine.dialect, "insert_returning", False)
    inserts: list[str] = []

    def on_statement(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if statement.startswith("INSERT INTO checkpoints"):
            inserts.append(statement)

    event.listen(engine, "before_cursor_execute", on_statement)
    try:
        saved = mgr.save(3, model=state(1), ema=state(2), aux=state(3))
    finally:
        event.remove(engine, "before_cursor_execute", on_statement)
    assert len(inserts) == len(streams) and not any("RETURNING" in s for s in inserts)
    for i, stream in enumerate(("model", "ema", "aux"), start=1):
        assert saved[stream].stream == stream
        assert value_of(mgr.load(saved[stream])) == float(i)


# ------------------------------------------------- the driver runner (ledger/driver.py)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
def test_a_driver_error_is_sqlalchemys_and_rolls_the_transaction_back(
    backend: str | None, open_manager: Opener
) -> None:
    """A statement the database refuses raises what exec_driver_sql raised (so the ledger
    translates it to DatabaseError with the driver's message), and nothing of the
    transaction it was in commits."""
    mgr = open_manager(db_url=backend, streams={"model": Keep(last=1)})
    ledger = mgr._ctx.ledger
    with pytest.raises(DatabaseError) as raised, ledger.transaction() as session:
        boundary_rows.run(session, "UPDATE checkpoints SET path = ? WHERE id = ?", ("planted", -1))
        boundary_rows.run(session, "INSERT INTO pointers (run_id, name) VALUES (?, ?)", (1, "x"))
    assert isinstance(raised.value.original, IntegrityError)
    assert "null" in str(raised.value).lower()  # the driver's own words reach the user
    with ledger.transaction(read=True) as session:
        names = boundary_rows.fetch(session, "SELECT name FROM pointers WHERE name = ?", ("x",))
    assert names == []


@SQLITE_ONLY
def test_a_listeners_own_error_propagates_unchanged(open_manager: Opener) -> None:
    """Only the driver's errors are wrapped: anything else a statement observer raises
    reaches the caller as itself (never wrapped, never its own cause)."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    engine = mgr._ctx.ledger.engine

    class Observed(Exception):
        pass

    def fail(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if statement.startswith("INSERT INTO checkpoints"):
            raise Observed(statement)

    event.listen(engine, "before_cursor_execute", fail)
    try:
        with pytest.raises(Observed) as raised:
            mgr.save(1, model=state(1))
    finally:
        event.remove(engine, "before_cursor_execute", fail)
    assert raised.value.__cause__ is None  # as raised, not wrapped around itself
    assert mgr.save(2, model=state(2))["model"].step == 2
    assert [c.step for c in mgr.checkpoints()] == [2]  # the failed intent left no row


@SQLITE_ONLY
def test_statement_observers_see_and_may_rewrite_each_driver_statement(
    open_manager: Opener,
) -> None:
    """``before_cursor_execute`` listeners run around the driver statements as they do
    around SQLAlchemy's own, ``retval=True`` ones included, and
    ``after_cursor_execute`` ones follow."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    engine = mgr._ctx.ledger.engine
    after: list[str] = []

    def rewrite(_c: Any, _cur: Any, statement: str, params: Any, *_: Any) -> Any:
        return statement.replace("SELECT 41", "SELECT 42"), params

    def seen(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        after.append(statement)

    event.listen(engine, "before_cursor_execute", rewrite, retval=True)
    event.listen(engine, "after_cursor_execute", seen)
    try:
        with mgr._ctx.ledger.transaction(read=True) as session:
            answer = boundary_rows.fetch(session, "SELECT 41", ())
    finally:
        event.remove(engine, "before_cursor_execute", rewrite)
        event.remove(engine, "after_cursor_execute", seen)
    assert answer == [(42,)]
    assert after[-1] == "SELECT 42"


def test_an_insert_whose_id_the_driver_does_not_report_is_refused() -> None:
    with pytest.raises(LedgerError, match="did not report the id"):
        boundary_rows._inserted_id(Executed([], None))
    assert boundary_rows._inserted_id(Executed([], 7)) == 7


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_a_lost_postgresql_connection_is_invalidated_and_replaced(
    backend: str, open_manager: Opener
) -> None:
    """The server drops the connection mid-transaction: the statement fails as a
    DatabaseError, the pool discards that connection (as SQLAlchemy does for its own
    statements: its ``invalidate`` event fires), and the next save runs on a new one."""
    mgr = open_manager(db_url=backend, streams={"model": Keep(last=1)})
    mgr.save(0, model=state(0))
    ledger = mgr._ctx.ledger
    invalidated: list[BaseException | None] = []
    event.listen(ledger.engine, "invalidate", lambda _c, _r, exc: invalidated.append(exc))
    with pytest.raises(DatabaseError, match="terminat"), ledger.transaction() as session:
        (pid,) = boundary_rows.fetch(session, "SELECT pg_backend_pid()", ())[0]
        with pg_admin(backend) as admin:
            admin.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
        boundary_rows.fetch(session, "SELECT 1", ())
    assert len(invalidated) == 1 and "terminat" in str(invalidated[0])
    assert mgr.save(1, model=state(1))["model"].step == 1
    assert value_of(mgr.load("latest")) == 1.0


@SQLITE_ONLY
def test_a_cursor_the_driver_cannot_open_is_a_database_error(open_manager: Opener) -> None:
    """The cursor itself is the driver's too: a connection it closed under us is a
    DatabaseError with the driver's words, never a bare driver exception."""
    mgr = open_manager(streams={"model": Keep(last=1)})

    def closed() -> Any:
        raise sqlite3.ProgrammingError("Cannot operate on a closed database.")

    with (
        pytest.raises(DatabaseError, match="closed database"),
        mgr._ctx.ledger.transaction() as session,
    ):
        real = session.connection()
        pooled = types.SimpleNamespace(cursor=closed, dbapi_connection=None)
        proxy = types.SimpleNamespace(
            dialect=real.dialect,
            dispatch=real.dispatch,
            connection=pooled,
            invalidate=lambda exc: dropped.append(exc),
        )
        dropped: list[BaseException] = []
        driver.execute(proxy, "SELECT 1")  # type: ignore[arg-type]
    assert len(dropped) == 1  # SQLite's word for a lost connection: the pool drops it
