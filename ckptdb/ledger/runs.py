"""Opening a run in its ledger: as its writer, or read-only.

The writer's open is one transaction after migrate-on-open: find or create
the run, store the requested stream policies, close attempts a crash left
running and start this process's attempt. A reader only looks: it needs a
current schema and a run rooted where it is asked, and changes nothing.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import inspect, select

from ..errors import LedgerError, SchemaVersionError
from ..location import location_of
from ..policies import Policy
from . import models as m
from . import rows
from .engine import (
    Ledger,
    newest_revision,
    normalize_url,
    open_ledger,
    readonly_sqlite_url,
    safe_url,
    translated,
)
from .netfs import sqlite_path


@dataclass(frozen=True)
class OpenedRun:
    """What a run is, as its ledger records it."""

    run_id: int
    name: str
    save_dir: Path
    policies: dict[str, Policy]
    attempt_id: int | None = None
    #: When the run was created (with its id and name, what makes its objects' names its own).
    created_at: dt.datetime | None = None


def ledger_url(root: Path, db_url: str | None, *, readonly: bool) -> str:
    """The URL of a run's ledger: ``db_url``, or the run's own SQLite file."""
    if db_url:
        return normalize_url(db_url)
    path = root / "ckptdb.sqlite"
    if readonly and not path.exists():
        raise LedgerError(f"no ckptdb run at {root} (no {path.name})")
    return readonly_sqlite_url(path) if readonly else f"sqlite:///{path}"


def open_as_writer(
    db: Ledger,
    root: Path,
    requested: dict[str, Policy] | None,
    save_dir: Path | None,
    *,
    adopt_single: bool,
    kind: str,
    default_streams: dict[str, Policy],
    world_size: int = 1,
) -> OpenedRun:
    """Migrate, then find or create the run and start an attempt, in one transaction."""
    with translated(f"cannot use the ledger of {root}"):
        db.migrate()
        with db.transaction() as session:
            run = rows.open_run(session, root, save_dir, adopt_single=adopt_single)
            policies = rows.sync_streams(session, run.id, requested, default_streams)
            attempt = rows.start_attempt(session, run.id, kind, world_size)
            rows.add_event(session, run.id, attempt.id, "attempt_started")
            return OpenedRun(
                run.id,
                run.name,
                location_of(run.save_dir),
                policies,
                attempt.id,
                run.created_at,
            )


def open_as_reader(db: Ledger, root: Path, *, adopt_single: bool) -> OpenedRun:
    """The run rooted at ``root``, read without writing; refuses an empty or old schema."""
    check_readable(db, str(root))
    with db.transaction(read=True) as session:
        run = rows.find_run(session, str(root), adopt_single=adopt_single)
        if run is None:
            raise LedgerError(f"the ledger has no run rooted at {root}")
        found = session.scalars(select(m.Stream).where(m.Stream.run_id == run.id))
        policies = {r.name: rows.policy_from_row(r) for r in found}
        return OpenedRun(
            run.id, run.name, rows.rebased_save_dir(run, root), policies, None, run.created_at
        )


def check_readable(db: Ledger, where: str) -> None:
    """Refuse a ledger a reader cannot read: no schema yet, or an older one (a reader
    never migrates). ``where`` names the run (its root) or the ledger in the errors."""
    schema = db.schema()
    if schema == "empty":
        raise LedgerError(
            f"no ckptdb run at {where}: the ledger {db.safe_url} has no ckptdb schema yet "
            "(a CheckpointManager creates it)"
        )
    if schema != "current":
        raise SchemaVersionError(
            f"the ledger of {where} uses an older schema ({', '.join(db.heads())}; this "
            f"ckptdb reads {newest_revision()}), and a reader never migrates: run "
            f"`ckptdb db upgrade {where}` (or open the run with a CheckpointManager)"
        )


def run_exists(root: Path, db_url: str, *, adopt_single: bool = False) -> bool:
    """Whether the ledger at ``db_url`` records a run rooted at ``root`` (with
    ``adopt_single``: or holds exactly one run, which a ledger file in the run's
    own directory does, wherever that directory has moved); creates nothing."""
    url = normalize_url(db_url)
    path = sqlite_path(url)
    if path is not None and not path.exists():
        return False
    db = open_ledger(url, readonly=True)
    try:
        with translated(f"cannot read the ledger {safe_url(url)}"), db.engine.connect() as conn:
            if not inspect(conn).has_table(m.Run.__tablename__):
                return False
            found = conn.execute(select(m.Run.id).where(m.Run.root == str(root))).first()
            if found is not None or not adopt_single:
                return found is not None
            return len(conn.execute(select(m.Run.id).limit(2)).all()) == 1
    finally:
        db.dispose()


def ledger_beside(dirpath: Path) -> Path:
    """The run root kept next to a checkpoint directory ``<parent>/<name>``:
    ``<parent>/.<name>.ckptdb`` (the Lightning integration's default ledger).

    Outside the directory, so it holds checkpoints only, and unique to it
    (two sibling directories have different names). Restart resolution
    looks for it the same way.
    """
    return dirpath.parent / f".{dirpath.name}.ckptdb"
