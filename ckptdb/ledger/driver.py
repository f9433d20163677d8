"""One statement on the DBAPI cursor of an open SQLAlchemy connection: the hot path's runner.

Why: ``Connection.exec_driver_sql`` costs ~20 µs of Python per statement
(an execution context, result metadata, a cursor wrapper), more than SQLite
takes to run most of the boundary's statements, and a boundary runs about
twenty of them. :func:`execute` runs the statement on the connection's own
DBAPI cursor, inside the connection's transaction, and keeps the two things
callers rely on from SQLAlchemy:

* **Errors** are SQLAlchemy's: a driver error becomes the same
  :class:`sqlalchemy.exc.DBAPIError` subclass ``exec_driver_sql`` raises, so
  :meth:`~ckptdb.ledger.engine.Ledger.transaction` translates it like any other,
  and a connection the driver reports as lost, or one interrupted mid-statement,
  is invalidated so that the pool replaces it (SQLAlchemy would also
  invalidate the pool's other connections on a lost one; PostgreSQL's
  pre-ping at checkout finds those).
* **Observers** still see every statement: ``before_cursor_execute`` and
  ``after_cursor_execute`` listeners on the engine or connection run around it
  (with no execution context: ``context`` is None), so statement counts,
  tracing and fault injection keep working.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.util import is_exit_exception

from ..errors import note_on

Params = tuple[Any, ...] | list[tuple[Any, ...]] | dict[str, Any] | list[dict[str, Any]]


class Executed(NamedTuple):
    """What a statement gave back: its rows (if it returns any), ``lastrowid``, and the
    driver's type code of each column (a PostgreSQL type OID; None on SQLite)."""

    rows: list[tuple[Any, ...]]
    lastrowid: int | None
    types: tuple[Any, ...] = ()


def execute(connection: Connection, sql: str, params: Params = ()) -> Executed:
    """Run ``sql`` (in the driver's parameter style) with ``params`` on ``connection``'s
    DBAPI connection; a list of parameter sets is one ``executemany``."""
    return _run(connection, sql, params, many=isinstance(params, list))


def executemany(connection: Connection, sql: str, rows: Iterable[Any]) -> None:
    """``sql`` once per row of ``rows``, which may be any iterable (a metric flush hands
    a generator: the driver consumes it row by row, no list of 100k tuples is built
    unless a listener is there to see it). A failure's message leaves the rows out."""
    _run(connection, sql, rows, many=True)


def _run(connection: Connection, sql: str, params: Any, *, many: bool) -> Executed:
    try:
        cursor = connection.connection.cursor()
    except Exception as exc:  # a connection the driver closed under us
        if not isinstance(exc, connection.dialect.loaded_dbapi.Error):
            raise
        raise _wrapped(connection, sql, None, exc, many) from exc
    try:
        if many and _listened(connection) and not isinstance(params, list):
            params = list(params)  # listeners may read the rows the driver then consumes
        sql, params = _before(connection, cursor, sql, params, many)
        if many:
            cursor.executemany(sql, params)
        else:
            cursor.execute(sql, params)
        _after(connection, cursor, sql, params, many)
        described = cursor.description
        rows = [tuple(row) for row in cursor.fetchall()] if described else []
        types = tuple(column[1] for column in described) if described else ()
        found = Executed(rows, getattr(cursor, "lastrowid", None), types)  # psycopg: none
    except BaseException as exc:
        error = exc
        if isinstance(exc, connection.dialect.loaded_dbapi.Error):
            error = _wrapped(connection, sql, None if many else params, exc, many)
        elif is_exit_exception(exc) and not connection.invalidated:
            # as SQLAlchemy does: an interrupt mid-statement leaves the connection in
            # a state nobody knows (psycopg may be mid-pipeline), so the pool drops it
            connection.invalidate(exc)
        _close_after(cursor, error)
        if error is exc:
            raise
        raise error from exc
    cursor.close()
    return found


def _listened(connection: Connection) -> bool:
    events = connection.dispatch
    return bool(events.before_cursor_execute or events.after_cursor_execute)


def _before(connection: Connection, cursor: Any, sql: str, params: Any, many: bool) -> Any:
    """Run the ``before_cursor_execute`` listeners as ``exec_driver_sql`` would: each
    returns the statement and parameters the next one and the driver get."""
    listeners = connection.dispatch.before_cursor_execute
    if listeners:
        for listener in listeners:
            sql, params = listener(connection, cursor, sql, params, None, many)
    return sql, params


def _after(connection: Connection, cursor: Any, sql: str, params: Any, many: bool) -> None:
    listeners = connection.dispatch.after_cursor_execute
    if listeners:
        listeners(connection, cursor, sql, params, None, many)


def _wrapped(connection: Connection, sql: str, params: Any, exc: Any, many: bool) -> Exception:
    """The driver's error ``exc`` as SQLAlchemy raises it: wrapped in its DBAPIError
    subclass (without the parameters of an ``executemany``: a metric flush's rows do
    not belong in a message), after invalidating a connection the driver reports as
    lost."""
    dialect = connection.dialect
    driver_error = dialect.loaded_dbapi.Error
    lost = dialect.is_disconnect(exc, connection.connection.dbapi_connection, None)
    if lost:
        connection.invalidate(exc)
    wrapped: Exception = DBAPIError.instance(
        sql,
        params,
        exc,
        driver_error,
        hide_parameters=many,
        connection_invalidated=lost,
        dialect=dialect,
        ismulti=many,
    )
    return wrapped


def _close_after(cursor: Any, primary: BaseException) -> None:
    """Close a cursor whose statement failed; a failure to close is noted on ``primary``
    (the error the caller gets), never raised in its place."""
    try:
        cursor.close()
    except Exception as exc:
        note_on(primary, f"closing the cursor failed too: {type(exc).__name__}: {exc}")
