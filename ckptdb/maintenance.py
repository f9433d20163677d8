"""Maintenance of a run's ledger as a database: its schema revision, migrating it.

The few operations the ``ckptdb db`` commands (and the commands that open a
run to repair it) need that neither public entry point offers:
:class:`~ckptdb.reader.RunReader` never writes nor migrates, and
:class:`~ckptdb.manager.CheckpointManager` migrates only as it opens a run to
write to it, creating the run if there is none. They live in the library, not
in the CLI, so that the CLI imports nothing of :mod:`ckptdb.ledger` (see
docs/architecture.md); this module only composes the ledger's functions, and
every SQL statement stays in :mod:`ckptdb.ledger`.
"""

from __future__ import annotations

from pathlib import Path

from .errors import InvalidArgumentError
from .ledger import engine, open_ledger
from .ledger.lock import writer_lock
from .ledger.netfs import check_ledger_location
from .ledger.runs import ledger_url, run_exists

__all__ = ["newest_revision", "require_run", "schema_revisions", "upgrade"]


def require_run(root: Path, db_url: str | None) -> None:
    """Refuse (:class:`~ckptdb.errors.InvalidArgumentError`) a ``root`` that holds no
    run, in its own SQLite ledger or in the ledger at ``db_url``; creates nothing.

    For a command that repairs an existing run with a ``CheckpointManager``,
    which would otherwise create an empty run where the user mistyped a path.
    """
    url = db_url or engine.default_sqlite_url(root.resolve())
    # the run's own SQLite file belongs to it wherever the directory went (copied,
    # moved, restored from a backup, mounted elsewhere), as when a manager opens it
    if not run_exists(root.resolve(), url, adopt_single=db_url is None):
        where = f" in the ledger {engine.safe_url(db_url)}" if db_url else ""
        raise InvalidArgumentError(f"no ckptdb run at {root}{where}")


def upgrade(root: Path, db_url: str | None) -> None:
    """Migrate the ledger of the run at ``root`` to this ckptdb's newest schema.

    Refuses a directory that holds no run (rather than creating a ledger there)
    and a SQLite ledger on a network filesystem, as opening a writer does; then
    migrates under the run's writer lock, so no trainer writes meanwhile (a
    running one makes this fail with :class:`~ckptdb.errors.LedgerLockedError`).
    """
    root = root.resolve()
    ledger_url(root, db_url, readonly=True)  # refuses a directory that holds no run
    url = ledger_url(root, db_url, readonly=False)
    check_ledger_location(url)
    lock = writer_lock(root, url)
    lock.acquire()
    try:
        ledger = open_ledger(url)
        try:
            ledger.migrate()
        finally:
            ledger.dispose()
    finally:
        lock.release()


def schema_revisions(root: Path, db_url: str | None) -> tuple[str, ...]:
    """The schema revision(s) of the ledger of the run at ``root``, read-only (empty for
    a database ckptdb never migrated); refuses a directory that holds no run."""
    ledger = open_ledger(ledger_url(root, db_url, readonly=True), readonly=True)
    try:
        return ledger.heads()
    finally:
        ledger.dispose()


def newest_revision() -> str:
    """The newest schema revision this version of ckptdb knows (what :func:`upgrade`
    migrates to)."""
    return engine.newest_revision()
