"""One statement on the DBAPI cursor of an open SQLAlchemy connection: the hot path's runner.

Why: ``Connection.exec_driver_sql`` costs ~20 µs of Python per statement
(an execution context, result metadata, a cursor wrapper), more than SQLite
takes to run most of the boundary's statements, and a boundary runs about
twenty of them. :func:`execute` runs the statement on the connection's own
DBAPI cursor, inside the connection's transaction, and keeps the two things
callers rely on from SQLAlchemy:

* **Errors** are SQLAlchemy's: a driver error becomes the same
  :class:`sqlalchemy.exc.DBAPIError` subclass ``exec_driver_sql`` raises, so
  :meth:`~ckptdb.ledger.engine.Ledger.transaction` translates it as before,
  and a connection the driver reports as lost is invalidated (the pool
  replaces it) exactly as SQLAlchemy would.
* **Observers** still see every statement: ``before_cursor_execute`` and
  ``after_cursor_execute`` listeners on the engine or connection run around it
  (with no execution context: ``context`` is None), so statement counts,
  tracing and fault injection keep working.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

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
    many = isinstance(params, list)
    dbapi_connection: Any = connection.connection.dbapi_connection
    cursor = dbapi_connection.cursor()
    try:
        sql, params = _before(connection, cursor, sql, params, many)
        if many:
            cursor.executemany(sql, params)
        else:
            cursor.execute(sql, params)
        _after(connection, cursor, sql, params, many)
        described = cursor.description
        rows = [tuple(row) for row in cursor.fetchall()] if described else []
        types = tuple(column[1] for column in described) if described else ()
        return Executed(rows, getattr(cursor, "lastrowid", None), types)  # psycopg: no lastrowid
    except Exception as exc:
        if not isinstance(exc, connection.dialect.loaded_dbapi.Error):
            raise
        raise _wrapped(connection, sql, params, exc, many) from exc
    finally:
        cursor.close()


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
    subclass, after invalidating a connection the driver reports as lost."""
    dialect = connection.dialect
    driver_error = dialect.loaded_dbapi.Error
    dbapi_connection = connection.connection.dbapi_connection
    lost = dialect.is_disconnect(exc, dbapi_connection, None)
    if lost:
        connection.invalidate(exc)
    wrapped: Exception = DBAPIError.instance(
        sql,
        params,
        exc,
        driver_error,
        connection_invalidated=lost,
        dialect=dialect,
        ismulti=many,
    )
    return wrapped
