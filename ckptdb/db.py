"""Engines, sessions and migrate-on-open: the one place that talks to the database.

SQLite ledgers run with WAL (readers never block the writer),
``synchronous=FULL`` (a commit that returned survives power loss), foreign
keys on and a busy timeout. pysqlite's implicit transactions are replaced by
explicit ones (SQLAlchemy's documented recipe) so that every ``Session``
transaction is a real ``BEGIN``...``COMMIT``: ``BEGIN IMMEDIATE`` for the
writer, plain ``BEGIN`` (a consistent snapshot) for readers.

Sessions are scoped only by :meth:`Ledger.transaction`; helpers elsewhere take
a session and never commit.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from .errors import LedgerError, SchemaVersionError

SQLITE_BUSY_TIMEOUT_MS = 10_000


def default_sqlite_url(root: Path) -> str:
    return f"sqlite:///{root / 'ckptdb.sqlite'}"


def readonly_sqlite_url(path: Path) -> str:
    return f"sqlite:///file:{path}?mode=ro&uri=true"


def create_ledger_engine(url: str, *, readonly: bool = False) -> Engine:
    """Create an engine for a ledger URL with ckptdb's connection settings."""
    if make_url(url).get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url)
    _configure_sqlite(engine, readonly=readonly)
    return engine


def _configure_sqlite(engine: Engine, *, readonly: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if readonly:
                cursor.execute("PRAGMA query_only = ON")
                # query_only does not cover ATTACH, which would create a file
                dbapi_connection.set_authorizer(_deny_attach)
            else:
                cursor.execute("PRAGMA journal_mode = WAL")
                cursor.execute("PRAGMA synchronous = FULL")
        finally:
            cursor.close()

    begin = "BEGIN" if readonly else "BEGIN IMMEDIATE"

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql(begin)


def _deny_attach(action: int, *_: object) -> int:
    if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH):
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def migrations_dir() -> Path:
    """Where the Alembic environment is: inside the wheel, or in a checkout."""
    try:
        return Path(str(importlib.resources.files("ckptdb.migrations")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "migrations"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    return cfg


def _check_known(script: ScriptDirectory, heads: tuple[str, ...], url: str) -> None:
    for head in heads:
        try:
            known = script.get_revision(head)
        except CommandError:
            known = None
        if known is None:
            raise SchemaVersionError(
                f"the ledger at {url} has schema revision {head!r}, which this version "
                "of ckptdb does not know (written by a newer ckptdb?); upgrade ckptdb"
            )


def migrate(engine: Engine) -> None:
    """Bring the ledger to the newest schema; refuse one newer than this code.

    Runs in one transaction on the caller's engine (and so under the caller's
    writer lock); an unknown revision is refused before anything is changed.
    """
    cfg = alembic_config()
    script = ScriptDirectory.from_config(cfg)
    with engine.begin() as conn:
        heads = MigrationContext.configure(conn).get_current_heads()
        _check_known(script, heads, engine.url.render_as_string(hide_password=True))
        if set(heads) == set(script.get_heads()):
            return
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def schema_is_current(engine: Engine) -> bool:
    """True when the ledger is at this code's head; raises if it is newer."""
    script = ScriptDirectory.from_config(alembic_config())
    with engine.connect() as conn:
        heads = MigrationContext.configure(conn).get_current_heads()
        conn.rollback()
    _check_known(script, heads, engine.url.render_as_string(hide_password=True))
    return set(heads) == set(script.get_heads())


class Ledger:
    """An engine plus the one way to open a transaction on it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session whose work commits on success and rolls back on error."""
        with self._sessions.begin() as session:
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


def open_ledger(url: str, *, readonly: bool = False) -> Ledger:
    try:
        return Ledger(create_ledger_engine(url, readonly=readonly))
    except Exception as exc:  # bad URL, missing driver
        raise LedgerError(f"cannot open ledger {url!r}: {exc}") from exc
