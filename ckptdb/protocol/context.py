"""The run context every part of a manager shares, and the metric buffer.

One :class:`RunContext` per open manager: where the run lives, its ledger
(only on the process that writes it: a single process, or the chief), its
payload store, its policies and the ids of the run and of this attempt. The
parts (publisher, loader, queries, reconciler) receive it instead of reaching
into each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CkptDBError
from ..ledger import Ledger, RunQueries
from ..ledger import rows as ledger_rows
from ..ledger.lock import RunLock
from ..policies import Policy
from ..storage.base import PayloadStore

METRIC_FLUSH_THRESHOLD = 100_000

Point = tuple[int, str, float, float]  # (step, name, value, wall time)


@dataclass
class MetricBuffer:
    """Metric points waiting for the next commit (or flush).

    A transaction inserts a prefix of the buffer; the prefix is dropped only
    after that transaction committed, so a failed commit loses no metric.
    """

    points: list[Point] = field(default_factory=list)

    def add(self, step: int, values: dict[str, float]) -> None:
        now = time.time()
        self.points.extend((step, name, v, now) for name, v in values.items())

    def insert_into(self, session: Any, run_id: int, attempt_id: int, limit: int | None) -> int:
        """Insert the buffer (or its first ``limit`` points) in ``session``; how many."""
        batch = self.points if limit is None else self.points[:limit]
        ledger_rows.insert_metrics(session, run_id, attempt_id, batch)
        return len(batch)

    def drop(self, count: int) -> None:
        del self.points[:count]

    def __len__(self) -> int:
        return len(self.points)


@dataclass
class RunContext:
    """One open run, as every part of the manager sees it."""

    root: Path
    save_dir: Path
    run_id: int
    attempt_id: int
    policies: dict[str, Policy]
    store: PayloadStore
    is_writer: bool
    db: Ledger | None = None
    lock: RunLock | None = None
    metrics: MetricBuffer = field(default_factory=MetricBuffer)
    #: Row ids whose files stay on disk if retention evicts them (see ``mgr.protect``).
    protected: set[int] = field(default_factory=set)
    #: Whether an evicted row may still be waiting for its pins to go (then each commit
    #: looks for the released ones); unknown at open, so it starts True.
    pins_waiting: bool = True

    @property
    def ledger(self) -> Ledger:
        """The ledger (the writer's only: a rank other than the chief has none)."""
        if self.db is None:
            raise CkptDBError("only the chief (rank 0) holds the ledger")
        return self.db

    def queries(self) -> RunQueries:
        return RunQueries(self.ledger, self.run_id, self.save_dir, self.policies)

    def event(self, kind: str, **fields: Any) -> None:
        """Record one event of this attempt in a transaction of its own."""
        with self.ledger.transaction() as session:
            ledger_rows.add_event(session, self.run_id, self.attempt_id, kind, **fields)

    def rel(self, path: Path) -> str:
        """A path inside the save directory, as the ledger stores it."""
        return path.relative_to(self.save_dir).as_posix()
