"""The run context every part of a manager shares, and the metric buffer.

One :class:`RunContext` per open manager: where the run lives, its ledger
(only on the process that writes it: a single process, or the chief), its
payload store, its policies and the ids of the run and of this attempt. The
parts (publisher, loader, queries, reconciler) receive it instead of reaching
into each other.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

from ..errors import CkptDBError
from ..ledger import Ledger, RunQueries
from ..ledger import rows as ledger_rows
from ..ledger.lock import RunLock
from ..policies import Policy
from ..record import COMMITTED, Checkpoint
from ..storage.base import PayloadStore
from .progress import Progress

METRIC_FLUSH_THRESHOLD = 100_000  # points, not calls

#: One buffered call: (step, its values, wall time). The dict is the buffer's own copy.
Call = tuple[int, dict[str, float], float]


@dataclass
class MetricBuffer:
    """Metric points waiting for the next commit (or flush).

    A transaction inserts a prefix of the buffer; the prefix is dropped only
    after that transaction committed, so a failed commit loses no metric.

    A call is kept as it came (step, a copy of its dict, wall time) instead of
    a tuple per point: the call is on the training loop's path at every step,
    and the rows are built once anyway, at insert time. The three
    go flat into one list, not as a tuple: a tuple holding a dict stays
    tracked by the garbage collector, whose collections then walk the whole
    buffer again and again (measured: twice the cost of the call); ints,
    floats and a dict of floats are not tracked. One ``extend`` of three also
    keeps a call whole for a thread reading the list meanwhile.

    Counts (``len``, a ``limit``, what ``drop`` removes) are in points, as
    before, so METRIC_FLUSH_THRESHOLD and a boundary's limit keep their
    meaning; a prefix may end inside a call, whose remaining points stay
    buffered. ``len`` is two counters, each written by one side only
    (``added`` by the thread that logs, ``dropped`` by the thread whose commit
    dropped the points), so a background commit dropping while the training
    thread logs never loses an update. What is inserted and dropped is decided
    by the entries themselves, never by the counters.
    """

    #: step, values, wall time, step, values, ... (three per call)
    entries: list[Any] = field(default_factory=list)
    added: int = 0  # points ever buffered
    dropped: int = 0  # points ever dropped after their commit

    def add(self, step: int, values: dict[str, float]) -> int:
        """Buffer a copy of ``values`` (the caller may reuse its dict); the points now buffered."""
        if values:
            self.entries.extend((step, values.copy(), time.time()))
            self.added += len(values)
        return self.added - self.dropped

    def insert_into(self, session: Any, run_id: int, attempt_id: int, limit: int | None) -> int:
        """Insert the buffer (or its first ``limit`` points) in ``session``; how many."""
        batch, count = self._prefix(limit)
        steps, values, walls = batch[0::3], batch[1::3], batch[2::3]
        ledger_rows.insert_metric_calls(session, run_id, attempt_id, steps, values, walls)
        return count

    def drop(self, count: int) -> None:
        """Forget the first ``count`` points (their commit is done)."""
        entries = self.entries
        whole, rest, taken = _split(entries, count)
        if rest:
            values = entries[3 * whole + 1]
            entries[3 * whole + 1] = dict(list(values.items())[rest:])
        del entries[: 3 * whole]
        self.dropped += taken

    def calls(self) -> list[Call]:
        """The buffered calls, oldest first."""
        entries = self.entries[:]  # a snapshot: another thread may log meanwhile
        return list(zip(entries[0::3], entries[1::3], entries[2::3], strict=True))

    def __len__(self) -> int:
        return self.added - self.dropped

    def _prefix(self, limit: int | None) -> tuple[list[Any], int]:
        """The entries of the first ``limit`` points (the last call cut), and their count."""
        entries = self.entries[:]  # a snapshot: another thread may log meanwhile
        if limit is None:
            return entries, sum(map(len, entries[1::3]))
        whole, rest, taken = _split(entries, limit)  # the snapshot's, not the live list's
        batch = entries[: 3 * whole]
        if rest:
            step, values, wall = entries[3 * whole : 3 * whole + 3]
            batch += (step, dict(list(values.items())[:rest]), wall)
        return batch, taken


def _split(entries: list[Any], count: int) -> tuple[int, int, int]:
    """The first ``count`` points (at most all): (whole calls, points of the next call, total).

    Walks the entries (in C: the sizes, their sum, or their running sum
    and a bisection), not the counters, so it is exact whatever the
    threads did. All of them (a flush) is the common case: one sum.
    """
    sizes = list(map(len, entries[1::3]))
    total = sum(sizes)
    if count >= total:
        return len(sizes), 0, total
    ends = list(accumulate(sizes))
    whole = bisect_right(ends, count)
    return whole, count - (ends[whole - 1] if whole else 0), count


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
    #: The number of ranks this attempt runs on (recorded with every checkpoint).
    world_size: int = 1
    #: The remote tier's store (``remote=``, the chief's only): where a load whose local
    #: copy is missing or corrupt finds the checkpoint's copy.
    remote: Any = None
    #: The tier name the remote's copies are recorded under (``replicas.tier``).
    remote_tier: str = "remote"
    #: This attempt's reported steps and blocked time (goodput, ``due``).
    progress: Progress = field(default_factory=Progress)

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

    def change_state(
        self,
        target: Checkpoint,
        state: str,
        *,
        event: str,
        detail: dict[str, Any],
        error: str | None,
    ) -> None:
        """One checkpoint's row set to ``state`` (``error`` recorded), its stream's latest
        re-pointed and ``event`` recorded, in one transaction: what a load that finds a
        bad payload and a restore that brings one back both do."""
        with self.ledger.transaction() as session:
            cleared = {"deleted_at": None} if state == COMMITTED else {}  # evicted, brought back
            ledger_rows.set_state(session, [target.id], state, error=error, **cleared)
            ledger_rows.repoint_latest(session, self.run_id, target.stream)
            ledger_rows.add_event(
                session,
                self.run_id,
                self.attempt_id,
                event,
                checkpoint_id=target.id,
                step=target.step,
                detail=detail,
            )

    def rel(self, path: Path) -> str:
        """A path inside the save directory, as the ledger stores it."""
        return path.relative_to(self.save_dir).as_posix()
