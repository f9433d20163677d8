"""The SQLite writer's held connection (ckptdb/ledger/held.py): kept between writer
transactions, given up by any transaction that fails, never shared by two at once."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ckptdb.errors import DatabaseError
from ckptdb.ledger import after_commit, driver
from ckptdb.ledger.engine import Ledger, open_ledger
from ckptdb.ledger.held import connection_of

WAIT = 10.0  # seconds any step of the threaded tests may wait before the test fails


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    db = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    with db.transaction() as session:
        driver.execute(
            connection_of(session), "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT UNIQUE)"
        )
    yield db
    db.dispose()


class Checkouts:
    """Counts the pool's checkouts of ``ledger``'s engine."""

    def __init__(self, ledger: Ledger) -> None:
        self.count = 0
        self.happened = threading.Event()
        event.listen(ledger.engine, "checkout", self._seen)

    def _seen(self, *_: Any) -> None:
        self.count += 1
        self.happened.set()


def dbapi(session: Any) -> Any:
    return connection_of(session).connection.dbapi_connection


def insert(session: Any, value: str) -> None:
    driver.execute(connection_of(session), "INSERT INTO t (v) VALUES (?)", (value,))


def values(ledger: Ledger) -> list[str]:
    with ledger.transaction(read=True) as session:
        return [v for (v,) in session.execute(text("SELECT v FROM t ORDER BY id"))]


def test_writer_transactions_keep_one_connection_out_of_the_pool(ledger: Ledger) -> None:
    checkouts = Checkouts(ledger)
    seen = []
    for i, durable in enumerate((True, False, True, False)):
        with ledger.transaction(durable=durable) as session:
            insert(session, f"v{i}")
            seen.append(dbapi(session))
    assert checkouts.count == 0
    assert all(c is seen[0] for c in seen)
    with ledger.transaction(read=True) as session:  # a reader still uses the pool
        assert dbapi(session) is not seen[0]
    assert checkouts.count == 1
    assert values(ledger) == ["v0", "v1", "v2", "v3"]


class Base(DeclarativeBase):
    pass


class Row(Base):
    __tablename__ = "t"
    id: Mapped[int] = mapped_column(primary_key=True)
    v: Mapped[str]


def test_an_orm_session_starts_empty_in_every_transaction(ledger: Ledger) -> None:
    """The held session is reused; what the ORM loaded in one transaction, and what
    was queued in its info, is let go."""
    ran: list[str] = []
    with ledger.transaction() as session:
        session.add(Row(v="a"))
        session.flush()
        loaded = session.scalars(select(Row)).one()
        assert loaded in session.identity_map.values()
        after_commit(session, lambda: ran.append("queued once"))
        session.info["a caller's own key"] = "left behind"
        first = session
    assert ran == ["queued once"]
    with ledger.transaction() as session:
        assert session is first  # the same session, closed and so reusable
        assert not session.in_transaction()
        assert list(session.identity_map.values()) == []
        assert set(session.info) == {"ckptdb_connection"}  # nothing left of the last one
        assert session.scalars(select(Row)).one() is not loaded  # read again, a new object
    assert ran == ["queued once"]


@pytest.mark.parametrize("failure", ["driver", "python", "interrupt"])
def test_a_failed_transaction_rolls_back_and_gives_its_connection_up(
    ledger: Ledger, failure: str
) -> None:
    with ledger.transaction() as session:
        insert(session, "kept")
    checkouts = Checkouts(ledger)
    expected: type[BaseException] = {
        "driver": DatabaseError,
        "python": RuntimeError,
        "interrupt": KeyboardInterrupt,
    }[failure]
    with pytest.raises(expected), ledger.transaction() as session:
        insert(session, "rolled back")
        if failure == "driver":
            insert(session, "kept")  # UNIQUE constraint failed
        if failure != "driver":
            raise expected("stop")
    assert checkouts.count == 0
    with ledger.transaction() as session:  # checked out again, clean
        insert(session, "after")
    assert checkouts.count == 1
    with ledger.transaction() as session:  # and held again
        insert(session, "later")
    assert checkouts.count == 1
    assert values(ledger) == ["kept", "after", "later"]


def test_a_failure_to_close_is_noted_on_the_error_raised(ledger: Ledger) -> None:
    def broken_close() -> None:
        raise OSError("close failed")

    with pytest.raises(RuntimeError) as caught, ledger.transaction() as session:
        insert(session, "x")
        session.close = broken_close  # type: ignore[method-assign]
        raise RuntimeError("the primary error")
    assert str(caught.value) == "the primary error"
    note = "closing its connection failed too: OSError: close failed"
    assert any(note in n for n in caught.value.__notes__)
    assert any(str(ledger.engine.url.database) in n for n in caught.value.__notes__)
    assert values(ledger) == []
    with ledger.transaction() as session:  # a new connection and session
        insert(session, "y")
    assert values(ledger) == ["y"]


def test_work_after_commit_may_write_on_the_held_connection(ledger: Ledger) -> None:
    checkouts = Checkouts(ledger)
    ran: list[str] = []

    def later() -> None:
        with ledger.transaction() as session:
            insert(session, "after commit")
        ran.append("later")

    with ledger.transaction() as session:
        insert(session, "first")
        after_commit(session, later)
    assert ran == ["later"]  # once
    assert checkouts.count == 0
    assert values(ledger) == ["first", "after commit"]


def test_a_second_writer_meanwhile_uses_the_pool_and_waits_its_turn(ledger: Ledger) -> None:
    """Two writer threads: the one that finds the held connection taken checks one out
    of the pool and waits at BEGIN IMMEDIATE until the first commits."""
    inside, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    used: dict[str, Any] = {}

    def first() -> None:
        try:
            with ledger.transaction() as session:
                used["first"] = dbapi(session)
                insert(session, "first")
                inside.set()
                assert go.wait(WAIT)
        except BaseException as exc:
            errors.append(exc)

    def second() -> None:
        try:
            with ledger.transaction() as session:
                used["second"] = dbapi(session)
                insert(session, "second")
        except BaseException as exc:
            errors.append(exc)

    a = threading.Thread(target=first, daemon=True)
    a.start()
    assert inside.wait(WAIT)
    checkouts = Checkouts(ledger)
    b = threading.Thread(target=second, daemon=True)
    b.start()
    assert checkouts.happened.wait(WAIT), "the second writer did not go to the pool"
    go.set()
    a.join(WAIT)
    b.join(WAIT)
    assert not a.is_alive() and not b.is_alive()
    assert errors == []
    assert used["first"] is not used["second"]
    assert values(ledger) == ["first", "second"]


def test_dispose_closes_the_held_connection(ledger: Ledger) -> None:
    with ledger.transaction() as session:
        held = dbapi(session)
    ledger.dispose()
    with pytest.raises(sqlite3.ProgrammingError):
        held.execute("SELECT 1")
    with ledger.transaction() as session:  # the ledger still works, on a new connection
        assert dbapi(session) is not held
        insert(session, "after dispose")
    assert values(ledger) == ["after dispose"]


def test_a_failed_transaction_runs_none_of_its_queued_work(ledger: Ledger) -> None:
    ran: list[str] = []
    with pytest.raises(RuntimeError), ledger.transaction() as session:
        insert(session, "x")
        after_commit(session, lambda: ran.append("failed one's"))
        raise RuntimeError("fails before COMMIT")
    with ledger.transaction() as session:
        insert(session, "y")
    assert ran == []
    assert values(ledger) == ["y"]


class RacingLock:
    """``lock``, whose next release first runs ``before_release`` (still holding it)."""

    def __init__(self, lock: Any, before_release: Any) -> None:
        self._lock = lock
        self._hook = before_release

    def acquire(self, blocking: bool = True) -> bool:
        return self._lock.acquire(blocking)

    def release(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()
        self._lock.release()


def test_dispose_racing_the_end_of_a_transaction_still_closes_the_connection(
    ledger: Ledger,
) -> None:
    """dispose() lands after the ending transaction checked for it, before it let go
    of the lock: dispose cannot take the lock, so the ending loan closes it."""
    writer = ledger._writer
    assert writer is not None
    with ledger.transaction() as session:
        held = dbapi(session)
        writer._lock = RacingLock(writer._lock, ledger.dispose)  # type: ignore[assignment]
        insert(session, "committed")
    with pytest.raises(sqlite3.ProgrammingError):
        held.execute("SELECT 1")
    assert values(ledger) == ["committed"]


def test_dispose_during_a_transaction_closes_the_connection_when_it_ends(ledger: Ledger) -> None:
    inside, go, done = threading.Event(), threading.Event(), threading.Event()
    used: dict[str, Any] = {}

    def writer() -> None:
        with ledger.transaction() as session:
            used["held"] = dbapi(session)
            insert(session, "committed")
            inside.set()
            assert go.wait(WAIT)
        done.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    assert inside.wait(WAIT)
    ledger.dispose()  # returns at once: the transaction keeps its connection
    used["held"].execute("SELECT 1")  # still open
    go.set()
    assert done.wait(WAIT)
    thread.join(WAIT)
    with pytest.raises(sqlite3.ProgrammingError):
        used["held"].execute("SELECT 1")
    assert values(ledger) == ["committed"]


def test_postgresql_writers_keep_using_the_pool(pg_url: str) -> None:
    """Its pre-ping at checkout finds a connection the server dropped meanwhile."""
    db = open_ledger(pg_url)
    try:
        checkouts = Checkouts(db)
        for _ in range(3):
            with db.transaction() as session:
                session.execute(text("SELECT 1"))
        assert checkouts.count == 3
    finally:
        db.dispose()


def test_a_close_failing_after_commit_is_logged_not_raised(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """Raising would tell the caller its commit failed; it did not."""

    def broken_close() -> None:
        raise OSError("close failed")

    writer = ledger._writer
    assert writer is not None
    with ledger.transaction() as session:
        insert(session, "committed")
        session.close = broken_close  # type: ignore[method-assign]
        writer.close()  # the ledger is disposed meanwhile: this loan's end closes it
    assert values(ledger) == ["committed"]
    assert "could not be closed after its transaction committed" in caplog.text
    assert "OSError: close failed" in caplog.text
    assert str(ledger.engine.url.database) in caplog.text


def test_a_close_asked_for_between_transactions_is_done_by_the_next(ledger: Ledger) -> None:
    """What a close() that found the connection lent leaves, when the loan ended
    before it could be seen there: the next transaction closes the old connection."""
    writer = ledger._writer
    assert writer is not None
    with ledger.transaction() as session:
        old = dbapi(session)
    writer._closing = True
    with ledger.transaction() as session:
        assert dbapi(session) is not old
        insert(session, "on a new connection")
    with pytest.raises(sqlite3.ProgrammingError):
        old.execute("SELECT 1")
    assert values(ledger) == ["on a new connection"]


def test_a_session_that_cannot_be_made_leaves_no_connection_checked_out(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = ledger._writer
    assert writer is not None
    ledger.dispose()  # the next transaction connects anew

    def no_session(**_: Any) -> Any:
        raise RuntimeError("no session")

    monkeypatch.setattr(writer, "_sessions", no_session)
    with pytest.raises(RuntimeError, match="no session") as caught, ledger.transaction():
        pass
    # while the error (and so its frames) lives, a connection not closed stays out
    assert ledger.engine.pool.checkedout() == 0
    del caught
    monkeypatch.undo()
    with ledger.transaction() as session:
        insert(session, "works")
    assert values(ledger) == ["works"]
