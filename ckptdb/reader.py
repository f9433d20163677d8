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

import os
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from .errors import LedgerError
from .ledger import RunQueries, open_ledger
from .ledger import models as m
from .ledger.queries import run_sql
from .ledger.runs import ledger_url, open_as_reader, run_exists
from .policies import Policy
from .record import Checkpoint

__all__ = ["RunReader", "ledger_url", "run_exists"]


class RunReader:
    """Queries one run's ledger without writing anything."""

    def __init__(self, root: str | os.PathLike[str], *, db_url: str | None = None) -> None:
        self.root = Path(root).resolve()
        self._db = open_ledger(ledger_url(self.root, db_url, readonly=True), readonly=True)
        self._closed = False
        try:
            run = open_as_reader(self._db, self.root, adopt_single=db_url is None)
        except BaseException:
            self.close()
            raise
        self.run_id, self.run_name, self.save_dir = run.run_id, run.name, run.save_dir
        self.policies: dict[str, Policy] = run.policies
        self._queries = RunQueries(self._db, self.run_id, self.save_dir, self.policies)

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

    def _open(self) -> RunQueries:
        if self._closed:
            raise LedgerError(f"the reader of {self.root} is closed")
        return self._queries

    def latest(self, stream: str = "model") -> Checkpoint | None:
        """The newest committed checkpoint of ``stream`` (by publication, not by mtime)."""
        return self._open().latest(stream)

    def best(self, stream: str = "best") -> list[Checkpoint]:
        """The members of a top-K stream, best first."""
        return self._open().best(stream)

    def checkpoints(
        self, stream: str | None = None, *, states: Iterable[str] = (m.COMMITTED,)
    ) -> list[Checkpoint]:
        """Checkpoints (committed ones unless ``states`` says otherwise), by stream then step."""
        return self._open().checkpoints(stream, states=states)

    def state_counts(self) -> dict[str, int]:
        return self._open().state_counts()

    def attempts(self) -> list[m.Attempt]:
        return self._open().attempts()

    def events(self, limit: int = 10) -> list[m.Event]:
        """The newest ``limit`` events, oldest first."""
        return self._open().events(limit)

    def metric_history(self, name: str) -> list[tuple[int, float, int]]:
        """(step, value, attempt id) of one metric, by step then attempt."""
        return self._open().metric_history(name)

    def metric_names(self) -> list[str]:
        return self._open().metric_names()

    def sql(self, statement: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only SQL statement; a statement that would write is refused."""
        self._open()
        return run_sql(self._db, statement)
