"""Following a run: what committed after a cursor, and being woken when it does.

A follower reads checkpoint rows by id, which is commit order for one run
(its single writer runs one boundary at a time). A row still ``pending``
stops the read there, so nothing behind it is skipped; an ``aborted`` row was
never visible and is passed over. On PostgreSQL each boundary's commit
transaction also sends ``NOTIFY`` on the run's channel (delivered only once
the transaction commits, so a woken follower always finds the data); on
SQLite followers poll with one indexed query.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from ..errors import DatabaseError, LedgerError
from ..record import Checkpoint
from . import models as m
from .engine import Ledger, translated
from .rows import to_record


@contextlib.contextmanager
def _driver_errors(what: str) -> Iterator[None]:
    """The raw driver connection's errors (outside SQLAlchemy) as DatabaseError."""
    try:
        with translated(what):
            yield
    except DatabaseError:
        raise
    except Exception as exc:
        if type(exc).__module__.split(".")[0] not in ("psycopg", "psycopg2"):
            raise
        raise DatabaseError(f"{what}: {str(exc).strip().splitlines()[0]}", exc) from exc


#: Rows read per query while catching up.
BATCH = 1000
#: On PostgreSQL commits wake followers; this recheck only bounds a missed wake-up.
NOTIFIED_RECHECK = 5.0


def channel(run_id: int) -> str:
    return f"ckptdb_run_{run_id}"


def notify_commit(session: Session, run_id: int) -> None:
    """Wake the run's followers once this transaction commits (PostgreSQL only)."""
    bind = session.get_bind()
    if bind.dialect.name == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, '')"), {"channel": channel(run_id)})


def published_after(
    session: Session, run_id: int, stream: str, after: int, limit: int = BATCH
) -> tuple[list[m.Checkpoint], int]:
    """Rows of ``stream`` published after row ``after``, and the new cursor.

    Published: committed at some point (a row since evicted, lost or found
    corrupt is returned too, with its state). The read stops at a pending
    row at the tail: its boundary may still commit. A pending row with later
    rows of the stream behind it is dead (the next boundary starts only once
    the previous one is settled, and a crashed one is only ever rolled back),
    so it is passed over like an aborted one.
    """
    found = list(
        session.scalars(
            select(m.Checkpoint)
            .where(m.Checkpoint.run_id == run_id, m.Checkpoint.stream == stream)
            .where(m.Checkpoint.id > after)
            .order_by(m.Checkpoint.id)
            .limit(limit)
        )
    )
    settled = None
    if any(row.state == m.PENDING for row in found):
        settled = session.scalar(  # the newest row of the stream whose boundary is over
            select(func.max(m.Checkpoint.id)).where(
                m.Checkpoint.run_id == run_id,
                m.Checkpoint.stream == stream,
                m.Checkpoint.state != m.PENDING,
            )
        )
    published: list[m.Checkpoint] = []
    cursor = after
    for row in found:
        if row.state == m.PENDING and (settled is None or row.id > settled):
            break  # still in flight: it may commit
        cursor = row.id
        if row.committed_at is not None:
            published.append(row)
    return published, cursor


def start_cursor(session: Session, run_id: int, stream: str) -> int:
    """The cursor of a follower that starts now: after everything published, but
    before a boundary still in flight (it commits after the follower started)."""
    pending = session.scalar(
        select(func.min(m.Checkpoint.id)).where(
            m.Checkpoint.run_id == run_id,
            m.Checkpoint.stream == stream,
            m.Checkpoint.state == m.PENDING,
        )
    )
    newest = session.scalar(
        select(func.max(m.Checkpoint.id)).where(
            m.Checkpoint.run_id == run_id, m.Checkpoint.stream == stream
        )
    )
    if pending is not None:
        return int(pending) - 1
    return int(newest) if newest is not None else 0


class Waiter:
    """Sleeps until the run may have committed something: NOTIFY, or a poll interval.

    On PostgreSQL (psycopg 3) it listens on a connection of its own, taken
    out of the engine's pool for good (an autocommit, listening connection
    must never serve the reader's read-only transactions) and closed with it.
    """

    def __init__(self, db: Ledger, run_id: int) -> None:
        self._conn: Any = None
        self._raw: Any = None
        if db.backend != "postgresql" or db.engine.dialect.driver != "psycopg":
            return  # polls
        with _driver_errors(f"cannot listen on the ledger {db.safe_url}"):
            raw = db.engine.raw_connection()
            driver: Any = raw.driver_connection
            raw.detach()  # never returned to the pool: closing it closes the connection
            try:
                driver.autocommit = True
                driver.execute(f'LISTEN "{channel(run_id)}"')
            except BaseException:
                driver.close()
                raise
        self._raw, self._conn = raw, driver  # (the detached wrapper is kept alive with it)

    @property
    def notified(self) -> bool:
        """Whether commits wake this waiter (else it polls)."""
        return self._conn is not None

    def wait(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self._conn is None:
            time.sleep(seconds)
            return
        with _driver_errors("lost the ledger connection while following"):
            for _ in self._conn.notifies(timeout=seconds, stop_after=1):
                pass

    def close(self) -> None:
        conn, self._raw, self._conn = self._conn, None, None
        if conn is not None:
            conn.close()


class Follower:
    """The iterator ``RunReader.follow`` returns: each checkpoint of one stream
    published after its cursor, once, in commit order.

    Made by :meth:`ckptdb.RunReader.follow`, not directly. Everything that can
    fail, and the cursor, is settled when it is made, not at the first
    ``next()``: a follower made before a commit sees it. Iteration stops after
    ``timeout`` idle seconds (one ``next()`` waiting with nothing new; the time
    the caller spends between two is not idle); ``cursor`` is the id of the last checkpoint
    handed out, what a restarted follower passes as ``since``. Close it (or
    leave its ``with`` block) to release its connection.

    Args:
        db: The reader's ledger.
        run_id: The run's id in that ledger.
        stream: The stream followed.
        save_dir: The run's save directory (records carry absolute paths).
        since: Start after this checkpoint id; None: after the stream's newest
            committed checkpoint now.
        timeout: Idle seconds before iteration stops; None: never.
        poll: Seconds between two looks at a SQLite ledger (PostgreSQL is told
            of each commit by NOTIFY).
        is_open: Whether the reader is still open.
        stop: Asked at each ``next()`` and after each wait: True ends the
            iteration (and closes the follower) as a timeout does.

    Raises:
        LedgerError: the ledger could not be read (from ``next()`` as well, and
            when the follower or its reader is closed).
    """

    def __init__(
        self,
        db: Ledger,
        run_id: int,
        stream: str,
        save_dir: Path,
        since: int | None,
        timeout: float | None,
        poll: float,
        is_open: Callable[[], bool],
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.db, self.run_id, self.stream, self.save_dir = db, run_id, stream, save_dir
        self.timeout, self.poll, self._is_open, self._stop = timeout, poll, is_open, stop
        self._waiter = Waiter(db, run_id)  # listening before the cursor is read
        try:
            if since is None:
                with db.transaction(read=True) as session:
                    since = start_cursor(session, run_id, stream)
        except BaseException:
            self._waiter.close()
            raise
        self.cursor = since
        self._ready: list[Checkpoint] = []
        self._idle_since = time.monotonic()

    def __iter__(self) -> Follower:
        return self

    def __next__(self) -> Checkpoint:
        # idle is the time this call waits: what the caller spent on the last checkpoint
        # (an evaluation of a backlog) is not idle, or a backlog would end the follow
        self._idle_since = time.monotonic()
        while True:
            if self._stop is not None and self._stop():
                self.close()
                raise StopIteration
            if self._ready:
                return self._ready.pop(0)
            if not self._is_open() or self._waiter is None:
                raise LedgerError("this follower (or its reader) is closed")
            full = self._fetch()
            now = time.monotonic()
            if self._ready:
                continue
            if full:
                continue  # catching up: the next batch at once
            left = None if self.timeout is None else self.timeout - (now - self._idle_since)
            if left is not None and left <= 0:
                self.close()
                raise StopIteration
            nap = NOTIFIED_RECHECK if self._waiter.notified else self.poll
            self._waiter.wait(nap if left is None else min(nap, left))

    def _fetch(self) -> bool:
        with self.db.transaction(read=True) as session:
            found, cursor = published_after(session, self.run_id, self.stream, self.cursor)
            self._ready = [to_record(row, self.save_dir) for row in found]
        moved, self.cursor = cursor != self.cursor, cursor
        return moved and not self._ready

    def close(self) -> None:
        """Release the follower's connection (idempotent); iteration then raises."""
        waiter, self._waiter = self._waiter, None  # type: ignore[assignment]
        if waiter is not None:
            waiter.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
