"""Read-only access to a run: for the CLI, notebooks and dashboards.

A reader takes no writer lock, starts no attempt and never reconciles, so it
works while a trainer holds the run. SQLite ledgers are opened with
``mode=ro`` and ``PRAGMA query_only`` (a write is refused by SQLite itself, not
by inspecting the statement), each query runs in one snapshot transaction,
and only committed data is visible (WAL readers never see a transaction in
progress). PostgreSQL readers run every transaction as ``REPEATABLE READ,
READ ONLY``: one snapshot of committed data, and the server refuses writes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import TracebackType
from typing import Any

from sqlalchemy import func, inspect, select
from sqlalchemy.exc import SQLAlchemyError

from . import ledger
from . import models as m
from .db import (
    Ledger,
    current_heads,
    normalize_url,
    open_ledger,
    readonly_sqlite_url,
    safe_url,
    schema_is_current,
)
from .errors import InvalidArgumentError, LedgerError
from .netfs import sqlite_path
from .queries import RunQueries


def ledger_url(root: Path, db_url: str | None, *, readonly: bool) -> str:
    if db_url:
        return normalize_url(db_url)
    path = root / "ckptdb.sqlite"
    if readonly and not path.exists():
        raise LedgerError(f"no ckptdb run at {root} (no {path.name})")
    return readonly_sqlite_url(path) if readonly else f"sqlite:///{path}"


def run_exists(root: Path, db_url: str) -> bool:
    """Whether the ledger at ``db_url`` records a run rooted at ``root``; creates nothing."""
    url = normalize_url(db_url)
    path = sqlite_path(url)
    if path is not None and not path.exists():
        return False
    db = open_ledger(url, readonly=True)
    try:
        with db.engine.connect() as conn:
            if not inspect(conn).has_table(m.Run.__tablename__):
                return False
            found = conn.execute(select(m.Run.id).where(m.Run.root == str(root))).first()
            return found is not None
    except SQLAlchemyError as exc:
        raise LedgerError(f"cannot read the ledger {safe_url(url)}: {exc}") from exc
    finally:
        db.dispose()


class RunReader(RunQueries):
    """Queries one run's ledger without writing anything."""

    def __init__(self, root: str | os.PathLike[str], *, db_url: str | None = None) -> None:
        self.root = Path(root).resolve()
        self._db: Ledger = open_ledger(ledger_url(self.root, db_url, readonly=True), readonly=True)
        self._closed = False
        try:
            self._load_run(adopt_single=db_url is None)
        except BaseException:
            self.close()
            raise

    def _load_run(self, *, adopt_single: bool) -> None:
        try:
            empty = not current_heads(self._db.engine)
            current = not empty and schema_is_current(self._db.engine)
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot read the ledger of {self.root}: {exc}") from exc
        if empty:
            raise LedgerError(
                f"no ckptdb run at {self.root}: the ledger "
                f"{self._db.engine.url.render_as_string(hide_password=True)} "
                "has no ckptdb schema yet (a CheckpointManager creates it)"
            )
        if not current:
            raise LedgerError(
                f"the ledger of {self.root} uses an older schema; "
                f"run `ckptdb db upgrade {self.root}` (or open it with a CheckpointManager)"
            )
        with self._db.transaction() as session:
            run = ledger.find_run(session, str(self.root), adopt_single=adopt_single)
            if run is None:
                raise LedgerError(f"the ledger has no run rooted at {self.root}")
            self.run_id = run.id
            self.run_name = run.name
            self.save_dir = ledger.rebased_save_dir(run, self.root)
            rows = session.scalars(select(m.Stream).where(m.Stream.run_id == run.id))
            self.policies = {r.name: ledger.policy_from_row(r) for r in rows}

    def __enter__(self) -> RunReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._db.dispose()

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerError(f"the reader of {self.root} is closed")

    def state_counts(self) -> dict[str, int]:
        self._check_open()
        with self._db.transaction() as session:
            result = session.execute(
                select(m.Checkpoint.state, func.count())
                .where(m.Checkpoint.run_id == self.run_id)
                .group_by(m.Checkpoint.state)
            )
            return {state: count for state, count in result}

    def attempts(self) -> list[m.Attempt]:
        self._check_open()
        with self._db.transaction() as session:
            query = select(m.Attempt).where(m.Attempt.run_id == self.run_id).order_by(m.Attempt.id)
            return list(session.scalars(query))

    def events(self, limit: int = 10) -> list[m.Event]:
        """The newest ``limit`` events, oldest first."""
        self._check_open()
        with self._db.transaction() as session:
            query = (
                select(m.Event)
                .where(m.Event.run_id == self.run_id)
                .order_by(m.Event.id.desc())
                .limit(limit)
            )
            return list(reversed(list(session.scalars(query))))

    def metric_history(self, name: str) -> list[tuple[int, float, int]]:
        """(step, value, attempt id) of one metric, by step then attempt."""
        self._check_open()
        with self._db.transaction() as session:
            query = (
                select(m.Metric.step, m.Metric.value, m.Metric.attempt_id)
                .where(m.Metric.run_id == self.run_id, m.Metric.name == name)
                .order_by(m.Metric.step, m.Metric.attempt_id, m.Metric.id)
            )
            return [(s, math.nan if v is None else v, a) for s, v, a in session.execute(query)]

    def metric_names(self) -> list[str]:
        self._check_open()
        with self._db.transaction() as session:
            query = select(m.Metric.name).where(m.Metric.run_id == self.run_id).distinct()
            return sorted(session.scalars(query))

    def sql(self, statement: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only SQL statement; a statement that would write is refused."""
        self._check_open()
        try:
            with self._db.transaction() as session:
                # no_parameters: the statement goes to the driver as is, so a literal
                # '%' (LIKE 'latest:%') is not taken for a placeholder by psycopg
                result = session.connection().exec_driver_sql(
                    statement, execution_options={"no_parameters": True}
                )
                if not result.returns_rows:
                    raise InvalidArgumentError("the statement returned no rows (only queries run)")
                return list(result.keys()), [tuple(row) for row in result.all()]
        except SQLAlchemyError as exc:
            message = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            raise InvalidArgumentError(f"SQL error: {message}") from exc
