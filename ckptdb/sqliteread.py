"""How a read-only connection to a SQLite ledger is locked down.

Both readers of a SQLite ledger use it: the full reader (``ckptdb.ledger``, through
SQLAlchemy) and the quick read (``ckptdb.quickread``, the standard library alone). One
definition, so ``ckptdb sql`` refuses the same statements whichever answers it.
"""

from __future__ import annotations

import sqlite3


def lock_read_only(connection: sqlite3.Connection) -> None:
    """Make ``connection`` refuse every write, the ones ``query_only`` misses included.

    ``PRAGMA query_only`` refuses writes to the ledger, but ``ATTACH`` (and so
    ``VACUUM INTO``) would still create a file beside it, and a later
    ``PRAGMA query_only = OFF`` would lift it for the statements after; the
    authorizer denies ``ATTACH``, ``DETACH`` and any change of ``query_only``.
    Both readers also open the file ``mode=ro``: this lock holds without it.

    Args:
        connection: A DB-API connection to the ledger file, outside any transaction.
    """
    connection.execute("PRAGMA query_only = ON")
    connection.set_authorizer(_authorize)


def _authorize(action: int, name: str | None, value: str | None, *_: object) -> int:
    if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA and (name or "").lower() == "query_only" and value:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK
