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
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from ..errors import DatabaseError
from . import models as m
from .engine import Ledger, translated


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


def channel(run_id: int) -> str:
    return f"ckptdb_run_{run_id}"


def notify_commit(session: Session, run_id: int) -> None:
    """Wake the run's followers once this transaction commits (PostgreSQL only)."""
    bind = session.get_bind()
    if bind.dialect.name == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, '')"), {"channel": channel(run_id)})


def published_after(
    session: Session, run_id: int, stream: str, after: int, limit: int = 1000
) -> tuple[list[m.Checkpoint], int]:
    """Rows of ``stream`` that were published after row ``after``, and the new cursor.

    Published: committed at some point (a row since evicted, lost or found
    corrupt is returned too, with its state). The read stops at the first
    row still pending.
    """
    found = session.scalars(
        select(m.Checkpoint)
        .where(m.Checkpoint.run_id == run_id, m.Checkpoint.stream == stream)
        .where(m.Checkpoint.id > after)
        .order_by(m.Checkpoint.id)
        .limit(limit)
    )
    published: list[m.Checkpoint] = []
    cursor = after
    for row in found:
        if row.state == m.PENDING:
            break
        cursor = row.id
        if row.committed_at is not None:
            published.append(row)
    return published, cursor


def newest_id(session: Session, run_id: int, stream: str) -> int:
    """The cursor that starts after everything ``stream`` has now (0: nothing yet)."""
    found = session.scalar(
        select(m.Checkpoint.id)
        .where(m.Checkpoint.run_id == run_id, m.Checkpoint.stream == stream)
        .order_by(m.Checkpoint.id.desc())
        .limit(1)
    )
    return int(found) if found is not None else 0


class Waiter:
    """Sleeps until the run may have committed something: NOTIFY, or a poll interval."""

    def __init__(self, db: Ledger, run_id: int) -> None:
        self._conn: Any = None
        if db.backend == "postgresql":
            with _driver_errors(f"cannot listen on the ledger {db.safe_url}"):
                raw = db.engine.raw_connection()
                try:
                    driver: Any = raw.driver_connection
                    driver.autocommit = True
                    driver.execute(f'LISTEN "{channel(run_id)}"')
                except BaseException:
                    raw.close()
                    raise
            self._raw, self._conn = raw, driver

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
        if self._conn is not None:
            self._conn = None
            self._raw.close()
