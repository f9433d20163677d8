"""Engines, transactions and migrate-on-open: the one place that talks to the database.

Every transaction goes through :meth:`Ledger.transaction`, which is also the
one place where a driver error becomes a ckptdb error
(:class:`~ckptdb.errors.DatabaseError`, the driver's error as ``__cause__``)
and where work queued with :func:`after_commit` runs, once COMMIT returned:
a caller cannot forget the file work that must follow a commit, and that work
never runs for a transaction that rolled back.

SQLite ledgers run with WAL (readers never block the writer),
``synchronous=FULL`` (a commit that returned survives power loss), foreign
keys on and a busy timeout. pysqlite's implicit transactions are replaced by
explicit ones (SQLAlchemy's documented recipe) so that every ``Session``
transaction is a real ``BEGIN``...``COMMIT``: ``BEGIN IMMEDIATE`` for the
writer, plain ``BEGIN`` (a consistent snapshot) for readers.

PostgreSQL ledgers (``postgresql+psycopg://...``; a bare ``postgresql://``
gets the psycopg driver) need no pragmas: the writer runs in ordinary
transactions, readers in ``REPEATABLE READ, READ ONLY`` ones (one consistent
snapshot per transaction, and a write is refused by the server itself).
Migrations on PostgreSQL hold a database-wide advisory lock, so two first
opens of an empty database cannot race.

Sessions are scoped only by :meth:`Ledger.transaction`; helpers elsewhere take
a session and never commit.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.resources
import re
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from .. import faults
from ..errors import (
    DatabaseError,
    LedgerError,
    SchemaVersionError,
    WriterLockLostError,
    note_on,
)
from ..record import LEDGER_FILE as RUN_LEDGER_FILE
from ..record import LEDGER_REVISION
from ..sqliteread import lock_read_only
from . import driver
from .held import CONNECTION, WriterConnection

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

SQLITE_BUSY_TIMEOUT_MS = 10_000
_DURABLE: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptdb_durable", default=True)
_READ_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptdb_read", default=False)
POSTGRES_DRIVER = "postgresql+psycopg"


def advisory_key(name: str) -> int:
    """A stable signed 64-bit key for a PostgreSQL advisory lock named ``name``."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


# Held (per transaction) while migrations run on a PostgreSQL ledger.
MIGRATION_LOCK_KEY = advisory_key("ckptdb:migrations")


#: The file name of a run's own SQLite ledger, in its root (defined in ckptdb.record,
#: which the standard-library read of ckptdb.quickread shares).
LEDGER_FILE = RUN_LEDGER_FILE


def default_sqlite_url(root: Path) -> str:
    return f"sqlite:///{root / LEDGER_FILE}"


def readonly_sqlite_url(path: Path) -> str:
    return f"sqlite:///file:{path}?mode=ro&uri=true"


def normalize_url(url: str) -> str:
    """The URL ckptdb connects with: ``postgresql://`` / ``postgres://`` get psycopg (3)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return url  # reported by open_ledger
    if parsed.drivername in ("postgresql", "postgres"):
        return parsed.set(drivername=POSTGRES_DRIVER).render_as_string(hide_password=False)
    return url


def backend_name(url: str) -> str:
    """``sqlite``, ``postgresql``, ... (empty for a URL that does not parse)."""
    try:
        return make_url(normalize_url(url)).get_backend_name()
    except ArgumentError:
        return ""


def safe_url(url: str) -> str:
    """The URL for messages: the password (if any) masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def one_line(exc: BaseException) -> str:
    """``exc`` for a message: a driver's error as its first line (no SQL, no link)."""
    return driver_message(exc) if isinstance(exc, SQLAlchemyError) else str(exc)


def unreachable(where: str, exc: BaseException) -> str:
    """The one line a user reads when the ledger at ``where`` could not be reached."""
    original = getattr(exc, "original", None) or exc
    return (
        f"the ledger {where} is unreachable ({driver_message(original)}); training can go "
        "on: the next checkpoint tries again"
    )


def _is_psycopg_operational(exc: BaseException) -> bool:
    kind = type(exc)
    return kind.__name__ == "OperationalError" and kind.__module__.startswith("psycopg")


def postgres_connect_args(url: str) -> dict[str, Any]:
    """``connect_timeout`` (:data:`CONNECT_TIMEOUT`) unless the URL sets its own."""
    if "connect_timeout" in make_url(url).query:
        return {}
    return {"connect_timeout": CONNECT_TIMEOUT}


def create_ledger_engine(url: str, *, readonly: bool = False) -> Engine:
    """Create an engine for a ledger URL with ckptdb's connection settings."""
    url = normalize_url(url)
    backend = make_url(url).get_backend_name()
    if backend == "postgresql":
        timeout = postgres_connect_args(url)
        if readonly:
            engine = create_engine(url, pool_pre_ping=True, connect_args=timeout)
            _configure_postgres_reader(engine)
            return engine
        # Pins and evictions rely on each statement seeing what committed before it
        # (see ledger/pins.py): never inherit another default from the server or role.
        return create_engine(
            url, pool_pre_ping=True, isolation_level="READ COMMITTED", connect_args=timeout
        )
    if backend != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url)
    _configure_sqlite(engine, readonly=readonly)
    return engine


def _configure_postgres_reader(engine: Engine) -> None:
    """Every reader transaction is one snapshot, and the server refuses writes in it.

    Issued per transaction (not as a session default), so a statement cannot
    switch it off for the statements that follow.
    """

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")


#: Where a SQLite connection remembers its ``synchronous`` level (its pool record's info,
#: which is cleared when the DBAPI connection is replaced).
_SYNC_LEVEL = "ckptdb_synchronous"


def _configure_sqlite(engine: Engine, *, readonly: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if readonly:
                lock_read_only(dbapi_connection)
            else:
                cursor.execute("PRAGMA journal_mode = WAL")
                # metric batches update three B-trees; a larger page cache (allocated
                # only as used) makes a 100k-point flush ~1.6x faster
                cursor.execute("PRAGMA cache_size = -65536")
                cursor.execute("PRAGMA synchronous = FULL")
                record.info[_SYNC_LEVEL] = "FULL"
        finally:
            cursor.close()

    if readonly:

        @event.listens_for(engine, "begin")
        def _on_read_begin(connection: Connection) -> None:
            driver.execute(connection, "BEGIN")

        return

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        if _READ_ONLY.get():  # a snapshot read: never waits for the writer (WAL)
            driver.execute(connection, "BEGIN")
            return
        # The safety level may only change between transactions (see Ledger.transaction);
        # set only when it differs from the connection's (a statement saved per boundary).
        level = "FULL" if _DURABLE.get() else "NORMAL"
        info = connection.connection.info
        if info.get(_SYNC_LEVEL) != level:
            info.pop(_SYNC_LEVEL, None)  # unknown until the PRAGMA has run
            driver.execute(connection, f"PRAGMA synchronous = {level}")
            info[_SYNC_LEVEL] = level
        driver.execute(connection, "BEGIN IMMEDIATE")


def migrations_dir() -> Path:
    """Where the Alembic environment is: inside the wheel, or in a checkout."""
    try:
        return Path(str(importlib.resources.files("ckptdb.migrations")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent.parent / "migrations"


#: The newest revision in migrations/ (tests/test_cold_start.py compares it with
#: Alembic's head). A ledger already at it opens without importing Alembic, whose
#: import is most of what a cold ``ckptdb latest`` would otherwise spend. Kept in
#: :mod:`ckptdb.record` so that :mod:`ckptdb.quickread` reads it without SQLAlchemy.
HEAD_REVISION = LEDGER_REVISION

#: Alembic's own table and column, read with plain SQL on the fast path.
VERSION_TABLE = "alembic_version"


def alembic_config() -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    return cfg


@functools.cache
def _scripts() -> ScriptDirectory:
    """The migrations this ckptdb ships, read once per process: reading them (some 5 ms)
    was a quarter of the time an open of a small run took."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


def _check_known(script: ScriptDirectory, heads: tuple[str, ...], url: str) -> None:
    from alembic.util import CommandError

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


def _stored_heads(conn: Connection) -> tuple[str, ...]:
    """The ledger's revision(s), as Alembic's ``get_current_heads`` reads them (its
    version table in the default schema; empty when there is none), without Alembic."""
    if not inspect(conn).has_table(VERSION_TABLE):
        return ()
    rows = conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").all()
    return tuple(row[0] for row in rows)


def migrate(engine: Engine) -> None:
    """Bring the ledger to the newest schema; refuse one newer than this code.

    Runs in one transaction on the caller's engine (and so under the caller's
    writer lock; on PostgreSQL also under a database-wide advisory lock, as
    runs of one database share its schema); an unknown revision is refused
    before anything is changed. A ledger at :data:`HEAD_REVISION` is left as it
    is without importing Alembic.
    """
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Released at COMMIT; a second opener waits here, then finds the schema current.
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
        heads = _stored_heads(conn)
        if heads == (HEAD_REVISION,):
            return
        from alembic import command

        script = _scripts()
        _check_known(script, heads, engine.url.render_as_string(hide_password=True))
        if set(heads) == set(script.get_heads()):
            return
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


def newest_revision() -> str:
    """The newest schema revision this version of ckptdb knows."""
    return HEAD_REVISION


def current_heads(engine: Engine) -> tuple[str, ...]:
    """The ledger's schema revision(s); empty for a database ckptdb never migrated."""
    with engine.connect() as conn:
        heads = _stored_heads(conn)
        conn.rollback()
    return heads


def schema_is_current(engine: Engine) -> bool:
    """True when the ledger is at this code's head; raises if it is newer."""
    heads = current_heads(engine)
    if heads == (HEAD_REVISION,):
        return True
    script = _scripts()
    _check_known(script, heads, engine.url.render_as_string(hide_password=True))
    return set(heads) == set(script.get_heads())


class Ledger:
    """An engine plus the one way to open a transaction on it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # A session joins the transaction of a connection begun by Ledger.transaction:
        # the connection (not the session) begins and commits, which costs a third of
        # the session's own lazy begin/commit, and a boundary runs three transactions.
        self._sessions = sessionmaker(expire_on_commit=False)
        self._writer = (
            WriterConnection(engine, self._sessions) if engine.dialect.name == "sqlite" else None
        )
        #: Why this process may no longer write to the run (another writer took it),
        #: asked before every writing transaction; set by the manager from its lock.
        self.fenced: Callable[[], str | None] = lambda: None

    @contextlib.contextmanager
    def transaction(self, *, durable: bool = True, read: bool = False) -> Iterator[Session]:
        """A session whose work commits on success and rolls back on error.

        ``read=True`` is for queries only: on SQLite a deferred ``BEGIN`` (a
        WAL snapshot) instead of ``BEGIN IMMEDIATE``, so a read on the training
        thread never waits for a commit running in the background.

        ``durable=False`` (SQLite: ``synchronous=NORMAL`` for this transaction)
        skips the fsync of the commit: it survives a process crash but maybe
        not a power loss. The protocol uses it only where losing the commit to
        a power loss is harmless (the intent row: reconcile then finds a temp
        file, or an unowned final file that it quarantines; the cleanup row:
        reconcile finishes the delete). The boundary's commit is always durable,
        and fsyncing the WAL also makes every earlier transaction durable.
        """
        reason = None if read else self.fenced()
        if reason is not None:  # a writer fenced off writes nothing more, anywhere
            raise WriterLockLostError(reason)
        token, read_token = _DURABLE.set(durable), _READ_ONLY.set(read)
        queued: list[Callable[[], None]] = []
        try:
            with translated(), self._begun(read, queued) as session:
                yield session
        finally:
            _READ_ONLY.reset(read_token)
            _DURABLE.reset(token)
        if not read:
            faults.point("commit_answered")  # a test loses the answer of a COMMIT here
        _run_after_commit(queued)

    @contextlib.contextmanager
    def _begun(self, read: bool, queued: list[Callable[[], None]]) -> Iterator[Session]:
        """A session in a begun transaction, committed when the block ends cleanly; the
        work queued for after the commit is moved into ``queued`` once COMMIT returned.

        A writer transaction on SQLite uses the held connection when it is free
        (see :mod:`~ckptdb.ledger.held`), any other one a connection of the pool.
        """
        held = None if read or self._writer is None else self._writer.take()
        if held is None:
            with self.engine.begin() as connection:
                session = self._sessions(bind=connection)
                session.info[CONNECTION] = connection
                try:
                    yield session
                    session.flush()  # what the ORM still holds, before COMMIT
                finally:
                    session.close()
            queued.extend(session.info.pop(_AFTER_COMMIT, []))
            return
        writer, failed = self._writer, None
        assert writer is not None
        try:  # one try from the loan to its end: an interrupt anywhere still ends it
            session = held.session
            with held.connection.begin():
                try:
                    yield session
                    session.flush()
                finally:
                    if session.in_transaction():  # the ORM was used: let go of its objects
                        session.close()
            queued.extend(session.info.pop(_AFTER_COMMIT, []))
        except BaseException as exc:
            failed = exc
            raise
        finally:
            writer.give_back(held, failed)

    def probe(self) -> None:
        """Connect once, so an unreachable ledger is reported before anything else happens."""
        with translated(f"cannot connect to the ledger {self.safe_url}"), self.engine.connect():
            pass

    def dispose(self) -> None:
        """Close the ledger's connections (the held writer one included; one still in a
        transaction closes when it ends). Like SQLAlchemy's engine, the ledger stays
        usable: a later transaction connects again."""
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            self.engine.dispose()

    def migrate(self) -> None:
        """Bring the schema to this code's head (see :func:`migrate`)."""
        with translated(f"cannot migrate the ledger {self.safe_url}"):
            migrate(self.engine)

    def heads(self) -> tuple[str, ...]:
        """The ledger's schema revision(s); empty for a database never migrated."""
        with translated(f"cannot read the ledger {self.safe_url}"):
            return current_heads(self.engine)

    def schema(self) -> str:
        """``empty`` (never migrated), ``current`` or ``older``; raises if newer."""
        with translated(f"cannot read the ledger {self.safe_url}"):
            if not current_heads(self.engine):
                return "empty"
            return "current" if schema_is_current(self.engine) else "older"

    @property
    def backend(self) -> str:
        """``sqlite``, ``postgresql``, ..."""
        return self.engine.dialect.name

    @property
    def safe_url(self) -> str:
        """The ledger's URL for messages, its password masked."""
        return self.engine.url.render_as_string(hide_password=True)

    @property
    def database(self) -> str:
        """The database file (SQLite) or name, for messages about this ledger."""
        return self.engine.url.database or self.safe_url


_AFTER_COMMIT = "ckptdb_after_commit"


def after_commit(session: Session, work: Callable[[], None]) -> None:
    """Run ``work`` once ``session``'s transaction has committed (never if it rolls back).

    Queued work runs in order, after COMMIT returned and the session closed,
    so it may open transactions of its own. An error in one piece of work does
    not stop the pieces after it (the file work a commit queued still
    happens); the first error is raised once all ran, later ones attached to
    it as notes. An interrupt (``KeyboardInterrupt``) stops the queue at once:
    what is left is found by the next reconcile. Either way the transaction's
    data is committed.
    """
    session.info.setdefault(_AFTER_COMMIT, []).append(work)


def _run_after_commit(queue: list[Callable[[], None]]) -> None:
    failures: list[Exception] = []
    for work in queue:
        try:
            work()
        except Exception as exc:
            failures.append(exc)
    if not failures:
        return
    first = failures[0]
    for later in failures[1:]:
        note_on(first, f"after the same commit, also: {type(later).__name__}: {later}")
    raise first


@contextlib.contextmanager
def translated(what: str = "the ledger") -> Iterator[None]:
    """Turn a driver error inside the block into :class:`DatabaseError`.

    The message keeps the driver's first line (with a URL's password masked
    by SQLAlchemy), so ``database is locked`` or ``connection refused`` reach
    the user; the driver's error stays available as ``__cause__``.
    """
    try:
        yield
    except SQLAlchemyError as exc:
        raise DatabaseError(f"{what}: {driver_message(exc)}", exc) from exc
    except DatabaseError as exc:
        if what == _DEFAULT_WHAT or exc.original is None:
            raise
        raise DatabaseError(f"{what}: {driver_message(exc.original)}", exc.original) from (
            exc.original
        )


_DEFAULT_WHAT = "the ledger"


def driver_message(exc: BaseException) -> str:
    """The first line of a driver's error (SQLAlchemy appends the statement and a link,
    on a line of its own or, for its own errors, at the end of the first)."""
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    first = _BACKGROUND.sub("", lines[0]).strip() if lines else ""
    return first or type(exc).__name__


_BACKGROUND = re.compile(r"\s*\(Background on this error at: \S+\)")
#: PostgreSQL's SQLSTATEs of a server that is going away or not there yet.
_SERVER_GONE = {"57P01", "57P02", "57P03"}  # admin shutdown, crash shutdown, cannot connect now
#: How long a connection attempt to a PostgreSQL ledger may take (seconds), unless
#: the URL says otherwise: a save during an outage fails within it, never hangs.
CONNECT_TIMEOUT = 10


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the ledger could not be reached now,
    and may be again later: a connection refused, lost or timed out, a server
    shutting down or starting up, a SQLite file locked past its busy timeout.
    Not bad SQL, a constraint, a missing table, a wrong password."""
    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        seen.add(id(found))
        if getattr(found, "connection_invalidated", False):
            return True  # SQLAlchemy saw the connection drop
        state = getattr(found, "sqlstate", None)
        if isinstance(state, str) and (state.startswith("08") or state in _SERVER_GONE):
            return True
        if state is None and _is_psycopg_operational(found):
            return True  # psycopg: an OperationalError without SQLSTATE had no server answer
        if isinstance(found, sqlite3.OperationalError) and "locked" in str(found):
            return True
        nxt = getattr(found, "orig", None) or getattr(found, "original", None)
        found = nxt if nxt is not None else found.__cause__
    return False


def open_ledger(url: str, *, readonly: bool = False) -> Ledger:
    try:
        return Ledger(create_ledger_engine(url, readonly=readonly))
    except Exception as exc:  # bad URL, missing driver
        hint = ""
        if isinstance(exc, ImportError) and backend_name(url) == "postgresql":
            hint = " (install the driver: pip install 'ckptdb[postgres]')"
        raise LedgerError(f"cannot open ledger {safe_url(url)!r}: {exc}{hint}") from exc
