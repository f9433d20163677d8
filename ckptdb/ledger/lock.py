"""One writer per run, and who holds it: a file lock or a PostgreSQL advisory lock.

Both implement :class:`RunLock`; :func:`writer_lock` picks one by ledger URL.

- **SQLite** (and any ledger that is not PostgreSQL): ``<root>/ckptdb.lock``
  (``filelock``, released by the OS when the holder dies, so a crash never
  leaves a stale lock). The holder writes its pid and host to
  ``<root>/ckptdb.owner`` so a refused second writer can say who is in the way.
- **PostgreSQL**: a session-level advisory lock (``pg_try_advisory_lock``) on a
  64-bit key derived from the run's resolved root, held by a dedicated
  connection for the writer's lifetime. The server releases it when that
  session ends (close, or the holder process dying), and a file lock on a
  shared filesystem would not be reliable across nodes. The lock connection's
  ``application_name`` is ``ckptdb pid=<pid> host=<host>``; a refused writer
  reads it from ``pg_stat_activity`` joined with ``pg_locks``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Protocol

from filelock import FileLock, Timeout
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from ..errors import (
    DatabaseError,
    LedgerError,
    LedgerLockedError,
    RunDirectoryError,
    WriterLockLostError,
)
from .engine import (
    advisory_key,
    backend_name,
    normalize_url,
    postgres_connect_args,
    safe_url,
    translated,
)

log = logging.getLogger("ckptdb.lock")

LOCK_NAME = "ckptdb.lock"
OWNER_NAME = "ckptdb.owner"
APPLICATION_NAME = re.compile(r"ckptdb pid=(\d+) host=(\S+)")
# Server-side TCP keepalives for the lock session, so a holder whose host
# vanishes (power loss, partition) frees the run within a few minutes.
KEEPALIVES = {"tcp_keepalives_idle": 60, "tcp_keepalives_interval": 10, "tcp_keepalives_count": 6}


class RunLock(Protocol):
    """The writer lock of one run."""

    def acquire(self) -> None:
        """Take the lock at once or raise :class:`LedgerLockedError` naming the holder."""

    #: Why this writer may never write again (another writer took the run), or None.
    lost: str | None

    def verify(self) -> None:
        """Raise :class:`WriterLockLostError` if the lock is lost for good; take it back
        if only its session ended (a server restart), or raise the driver's
        :class:`DatabaseError` while the server cannot be reached (try again later)."""

    def give_up(self, reason: str) -> None:
        """Another writer took the run (``reason``): release, and refuse every later verify."""

    def release(self) -> None:
        """Give the lock back (idempotent)."""


def writer_lock(root: Path, url: str) -> RunLock:
    """The lock that guards writers of the run rooted at ``root`` with ledger ``url``."""
    if backend_name(url) == "postgresql":
        return AdvisoryWriterLock(root, url)
    return FileWriterLock(root)


def replicator_lock(root: Path, url: str) -> AdvisoryWriterLock:
    """The PostgreSQL lock that keeps a run to one replicator across machines (the
    lock file in the run's root only covers one machine); keyed, as the writer's
    is, by the run's root (the run's name on every machine), apart from it."""
    return AdvisoryWriterLock(root, url, name=f"ckptdb:replicator:{root}", role="replicator")


def _locked_error(
    root: Path, holder: dict[str, object], fallback: str, role: str = "writer"
) -> LedgerLockedError:
    who = (
        f"pid {holder.get('pid')} on host {holder.get('host')}"
        if "pid" in holder and "host" in holder
        else fallback
    )
    if role != "writer":
        return LedgerLockedError(
            f"run {root} has a {role} already, held by {who}: one {role} per run",
            holder=holder,
        )
    return LedgerLockedError(
        f"run {root} is open for writing by {who}; only one writer per run "
        "(readers such as `ckptdb status` need no lock)",
        holder=holder,
    )


def _remove_stale_records(root: Path) -> None:
    """The owner records a crashed writer left half-made (``.ckptdb.owner.<pid>``,
    written but never renamed): the lock is ours, so none of them is being written."""
    for stale in root.glob(f".{OWNER_NAME}.*"):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            continue
        except OSError as exc:  # another user's, say: it costs a few bytes, not the run
            log.warning("cannot remove %s, a crashed writer's leftover: %s", stale, exc)


class FileWriterLock:
    """``<root>/ckptdb.lock``, with the holder recorded in ``<root>/ckptdb.owner``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lost: str | None = None
        self._lock = FileLock(str(root / LOCK_NAME), timeout=0, thread_local=False)

    def acquire(self) -> None:
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise _locked_error(self.root, self._read_owner(), "another process") from None
        except OSError as exc:
            raise RunDirectoryError(f"cannot lock the run {self.root}: {exc}") from exc
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        tmp = self.root / f".{OWNER_NAME}.{os.getpid()}"
        try:
            _remove_stale_records(self.root)
            tmp.write_text(json.dumps(owner))
            os.replace(tmp, self.root / OWNER_NAME)
        except OSError as exc:
            self._lock.release()
            raise RunDirectoryError(f"cannot record the writer of {self.root}: {exc}") from exc

    def _read_owner(self) -> dict[str, object]:
        try:
            data = json.loads((self.root / OWNER_NAME).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def verify(self) -> None:
        """A file lock cannot be lost while the process lives (unless given up)."""
        if self.lost is not None:
            raise WriterLockLostError(self.lost)

    def give_up(self, reason: str) -> None:
        self.lost = reason
        self.release()

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()


_HOLDER_QUERY = text(
    """
    SELECT a.pid, a.application_name, host(a.client_addr) AS client_addr
    FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid::bigint = :hi AND l.objid::bigint = :lo
    """
)


class AdvisoryWriterLock:
    """A session-level PostgreSQL advisory lock per run, on a dedicated connection."""

    def __init__(
        self, root: Path, url: str, *, name: str | None = None, role: str = "writer"
    ) -> None:
        self.root = root
        self.url = normalize_url(url)
        self.key = advisory_key(name if name is not None else f"ckptdb:run:{root}")
        self.role = role  # what holds it: the run's writer, or its replicator
        self.lost: str | None = None
        self._engine: Engine | None = None
        self._conn: Connection | None = None

    def acquire(self) -> None:
        name = f"ckptdb pid={os.getpid()} host={socket.gethostname()}"
        try:
            engine = create_engine(
                self.url,
                poolclass=NullPool,
                connect_args={"application_name": name[:63], **postgres_connect_args(self.url)},
            )
        except ImportError as exc:
            raise LedgerError(
                f"cannot open ledger {safe_url(self.url)!r}: {exc} "
                "(install the driver: pip install 'ckptdb[postgres]')"
            ) from exc
        try:
            with translated(f"cannot connect to the ledger {safe_url(self.url)}"):
                conn = engine.connect()
        except DatabaseError:
            engine.dispose()
            raise
        try:
            self._try_lock(conn)
        except BaseException:
            conn.close()
            engine.dispose()
            raise
        self._engine, self._conn = engine, conn

    def _try_lock(self, conn: Connection) -> None:
        with translated(f"cannot take the writer lock of run {self.root} in {safe_url(self.url)}"):
            for setting, value in KEEPALIVES.items():  # ignored on a Unix socket
                conn.exec_driver_sql(f"SET {setting} = {value}")
            got = conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": self.key})
            locked = bool(got.scalar())
            holder = {} if locked else self._holder(conn)
            conn.commit()  # the lock belongs to the session, not to this transaction
        if not locked:
            raise _locked_error(self.root, holder, "another PostgreSQL session", self.role)

    def _holder(self, conn: Connection) -> dict[str, object]:
        hi, lo = (self.key >> 32) & 0xFFFFFFFF, self.key & 0xFFFFFFFF
        row = conn.execute(_HOLDER_QUERY, {"hi": hi, "lo": lo}).first()
        if row is None:  # released in the meantime
            return {}
        holder: dict[str, object] = {"backend_pid": row.pid}
        if row.client_addr is not None:
            holder["client_addr"] = row.client_addr
        match = APPLICATION_NAME.match(row.application_name or "")
        if match is not None:
            holder["pid"], holder["host"] = int(match.group(1)), match.group(2)
        return holder

    def verify(self) -> None:
        """The lock session answers; or, when it ended (the server restarted, the
        connection dropped), the lock is taken again on a new session.

        Taken again only if no one holds it: a writer that opened the run in
        between holds it (then this one is fenced off for good), and one that
        opened and closed since is caught by the fence every commit checks
        (:func:`ckptdb.ledger.boundary_rows.check_writer`). While the server
        cannot be reached, the driver's :class:`DatabaseError` is raised and
        the next call tries again.
        """
        if self.lost is not None:
            raise WriterLockLostError(self.lost)
        conn = self._conn
        if conn is not None:
            try:
                with translated("the lock session"):
                    conn.exec_driver_sql("SELECT 1")
                    conn.commit()
                return
            except DatabaseError as exc:
                log.warning(
                    "ckptdb: the PostgreSQL session holding the writer lock of run %s ended "
                    "(%s); taking the lock again",
                    self.root,
                    exc,
                )
                self._drop_session()
        try:
            self.acquire()
        except LedgerLockedError as exc:
            self.give_up(
                f"lost the writer lock of run {self.root}: its PostgreSQL session ended and "
                f"another writer holds it now ({exc}); this manager never commits again: "
                "close it"
            )
            raise WriterLockLostError(self.lost) from exc
        log.warning("ckptdb: the writer lock of run %s is held again", self.root)

    def give_up(self, reason: str) -> None:
        self.lost = reason
        self.release()

    def _drop_session(self) -> None:
        conn, engine = self._conn, self._engine
        self._conn = self._engine = None
        try:
            if conn is not None:
                conn.invalidate()  # never returned to a pool, never rolled back on a dead socket
        finally:
            if engine is not None:
                engine.dispose()

    def release(self) -> None:
        conn, engine = self._conn, self._engine
        self._conn = self._engine = None
        if conn is None or engine is None:
            return
        try:
            # Ending the session releases the lock anyway; unlocking first is just tidy,
            # so a failure here (the session is already gone) is logged, not raised.
            try:
                with translated("unlock"):
                    conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": self.key})
                    conn.commit()
            except DatabaseError as exc:
                log.debug("ckptdb: %s; closing the lock session releases it", exc)
        finally:
            conn.close()
            engine.dispose()

    def __repr__(self) -> str:
        return f"AdvisoryWriterLock({self.root!s}, key={self.key})"
