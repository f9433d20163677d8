"""The writer's connection, kept checked out between a SQLite ledger's transactions.

Why: a boundary runs two or three short transactions, and a transaction on
a pooled connection checks it out of SQLAlchemy's pool, builds a
``Connection`` and an ORM ``Session`` around it, and gives all of it back at
the end. Measured in place (saves of a tiny payload, the three ways
alternated in one process), that set-up and tear-down is ~0.6 ms of CPU per
save for the pool and ~0.35 ms for the sessions, a fifth of a tiny save: far
more than the same code costs in a tight loop, because a save runs it
between file writes and fsyncs, with cold caches. A transaction on the held
connection only begins and commits; its session is made once and closed
only when the ORM was used in it.

What it shares with a pooled connection: every transaction is a real
``BEGIN IMMEDIATE`` ... ``COMMIT`` through SQLAlchemy's ``Connection.begin``
(so its ``begin`` listeners, the ``synchronous`` level and error translation
apply to it as to any), and the pool serves readers and any writer
transaction that finds the held connection in use (it then waits at
``BEGIN IMMEDIATE`` like any other writer).
What must not outlive a failure does not: a transaction that raises for any
reason (a driver error, a lost connection, an interrupt) gives the
connection and its session up: the session is closed and the connection goes
back to the pool, whose reset on return rolls back whatever was left (a lost
one is replaced), and the next transaction checks one out again. No state of
a failed transaction is reused.

Not used on PostgreSQL: there the pool's pre-ping at checkout finds a
connection the server dropped while training ran for an hour between two
saves, and a held connection would skip that check.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from ..errors import note_on

log = logging.getLogger(__name__)

#: Where a ledger session keeps its transaction's connection (see :func:`connection_of`).
CONNECTION = "ckptdb_connection"


def connection_of(session: Session) -> Connection:
    """The connection of a ledger session's transaction, without walking the session's
    state machine (``session.connection()`` does, on every call; it also begins the
    ORM's own transaction, which a session that never used the ORM need not close)."""
    found = session.info.get(CONNECTION)
    if found is None:
        found = session.info[CONNECTION] = session.connection()
    assert isinstance(found, Connection)
    return found


@dataclass(frozen=True)
class Held:
    """The connection and the session that goes with it, taken by one transaction."""

    connection: Connection
    session: Session


class WriterConnection:
    """One connection of ``engine`` and its session, lent to one transaction at a time.

    :meth:`close` (the ledger's ``dispose``) closes it at once when it is not
    lent, else asks the transaction using it to close it when it ends; a later
    transaction checks out a new one, as SQLAlchemy's engine stays usable after
    its own ``dispose``.
    """

    def __init__(self, engine: Engine, sessions: Callable[..., Session]) -> None:
        self._engine = engine
        self._sessions = sessions
        self._lock = threading.Lock()
        self._held: Held | None = None
        self._closing = False  # close() found it lent: the loan's end closes it

    def take(self) -> Held | None:
        """The held connection for one transaction, or None while another one uses it:
        the caller then uses the pool."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closing:  # asked for by a close() that found the lock taken
                self._closing = False
                old, self._held = self._held, None
                if old is not None:
                    try:
                        _close(old, discard=True)
                    except Exception as exc:  # not this transaction's business
                        self._report(exc, None, "after the ledger was disposed")
            if self._held is None:
                self._held = self._connect()
            held = self._held
            held.session.info.clear()  # what the last transaction left (its queue is gone)
            held.session.info[CONNECTION] = held.connection
        except BaseException:
            self._lock.release()
            raise
        return held

    def _connect(self) -> Held:
        connection = self._engine.connect()
        try:
            return Held(connection, self._sessions(bind=connection))
        except BaseException:
            connection.close()
            raise

    def give_back(self, held: Held, failed: BaseException | None = None) -> None:
        """End ``held``'s loan. After a failure (``failed``) or when a :meth:`close` was
        asked for, the connection and session are closed. Never raises: an error
        closing them is noted on ``failed`` (the error the caller raises) or, after a
        transaction that committed, logged: raising it would tell the caller that
        its commit failed."""
        try:
            if failed is not None or self._closing:
                closing, self._closing = self._closing, False
                self._held = None
                try:
                    _close(held, discard=closing)
                except Exception as exc:
                    self._report(exc, failed, "after its transaction committed (the commit stands)")
        finally:
            self._lock.release()
        if self._closing:  # asked for after the check above, while this loan held the lock
            try:
                self._close_if_asked()
            except Exception as exc:
                self._report(exc, failed, "after its transaction committed (the commit stands)")

    def close(self) -> None:
        """Close the held connection now, or (lent) when its transaction ends."""
        self._closing = True  # before trying the lock: a loan ending now sees it
        self._close_if_asked()

    def _close_if_asked(self) -> None:
        """Close the held connection if a close is (still) asked for and it is not lent.
        Checked under the lock: a close another thread has done meanwhile is not done
        again, to a connection taken since."""
        if not self._lock.acquire(blocking=False):
            return  # lent: the loan's end closes it
        try:
            if not self._closing:
                return
            self._closing = False
            held, self._held = self._held, None
            if held is not None:
                _close(held, discard=True)
        finally:
            self._lock.release()

    def _report(self, error: Exception, failed: BaseException | None, when: str) -> None:
        """An error closing the held connection, with the ledger it belongs to: a note
        on the error the transaction raises (``failed``), else a log record (``when``
        it happened): raised, it would fail a transaction that committed, or one that
        has nothing to do with it."""
        ledger = self._engine.url.database  # SQLite only: a file name, no credential
        note = f"closing its connection failed too: {type(error).__name__}: {error} ({ledger})"
        if failed is not None:
            note_on(failed, note)
        else:
            log.error(
                "ckptdb: the ledger's writer connection could not be closed %s: %s: %s (%s)",
                when,
                type(error).__name__,
                error,
                ledger,
            )


def _close(held: Held, *, discard: bool = False) -> None:
    """Close the session and hand the connection back to the pool, whose reset on return
    rolls back whatever a failed transaction left. ``discard`` (the ledger is being
    disposed): close the driver's connection itself, which a pool disposed meanwhile
    would otherwise keep."""
    try:
        held.session.close()
    finally:
        if discard:
            held.connection.invalidate()
        held.connection.close()
