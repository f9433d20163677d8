"""Read-side questions about a run, for the writer and read-only readers alike.

Every answer comes from the ledger only (never from file names or mtimes),
each in one snapshot transaction (``read=True``: on SQLite a deferred
``BEGIN``, so a read never waits for a commit running in the background).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from ..errors import (
    ArgumentTypeError,
    CheckpointNotFoundError,
    DatabaseError,
    InvalidArgumentError,
)
from ..location import is_object_url, relative_within
from ..policies import INT64_MAX, Policy, policy_of
from ..record import Checkpoint
from . import lookup, rows
from . import models as m
from .engine import Ledger


class RunQueries:
    """What is latest, best, committed: one run's questions, answered from its ledger."""

    def __init__(
        self, db: Ledger, run_id: int, save_dir: Path, policies: Mapping[str, Policy]
    ) -> None:
        self.db, self.run_id, self.save_dir, self.policies = db, run_id, save_dir, policies

    def policy(self, stream: str) -> Policy:
        """The stream's policy; an unknown stream is an error naming the known ones."""
        return policy_of(self.policies, stream)

    def latest(self, stream: str = "model") -> Checkpoint | None:
        """The newest committed checkpoint of ``stream`` (by publication, not by mtime)."""
        self.policy(stream)
        with self.db.transaction(read=True) as session:
            return lookup.latest(session, self.run_id, stream, self.save_dir)

    def best(self, stream: str = "best") -> list[Checkpoint]:
        """The members of a ranked (top-K) stream, best first."""
        policy = self.policy(stream)
        if policy.ranking_metric is None:
            raise InvalidArgumentError(f"stream {stream!r} is not a TopK stream")
        with self.db.transaction(read=True) as session:
            found = rows.rows_in_state(session, self.run_id, [m.COMMITTED], stream)
        by_id = {r.id: r for r in found}
        ranked = policy.ranked(rows.entries(found))
        return [rows.to_record(by_id[e.id], self.save_dir) for e in ranked]

    def checkpoints(
        self, stream: str | None = None, *, states: Iterable[str] = (m.COMMITTED,)
    ) -> list[Checkpoint]:
        """Checkpoints (committed ones unless ``states`` says otherwise), by stream then step."""
        if stream is not None:
            self.policy(stream)
        with self.db.transaction(read=True) as session:
            found = rows.rows_in_state(session, self.run_id, tuple(states), stream)
        return [rows.to_record(r, self.save_dir) for r in found]

    def name_in_use(self, name: str) -> bool:
        """Whether a live row (pending, committed, deleting, lost or corrupt) owns ``name``
        (a path relative to the save directory)."""
        with self.db.transaction(read=True) as session:
            return rows.path_in_use(session, self.run_id, name)

    def newest_row_at(self, rel: str) -> tuple[str, str | None] | None:
        """The state and error text of the newest row, in any state, whose path is ``rel``
        (relative to the save directory): what the ledger knows of a name that is not
        committed. For error messages: not indexed by path."""
        with self.db.transaction(read=True) as session:
            query = select(m.Checkpoint.state, m.Checkpoint.error).filter_by(
                run_id=self.run_id, path=rel
            )
            row = session.execute(query.order_by(m.Checkpoint.id.desc()).limit(1)).first()
        return (row[0], row[1]) if row is not None else None

    def find_committed(self, **where: Any) -> Checkpoint | None:
        """The newest committed row matching ``where`` (column=value), by an indexed query."""
        with self.db.transaction(read=True) as session:
            query = select(m.Checkpoint).filter_by(run_id=self.run_id, state=m.COMMITTED, **where)
            row = session.scalars(query.order_by(m.Checkpoint.id.desc()).limit(1)).first()
            return rows.to_record(row, self.save_dir) if row is not None else None

    def resolve(self, which: object, stream: str | None, run: object = None) -> Checkpoint:
        """The committed checkpoint ``which`` names in this run.

        ``which``: ``"latest"`` (of ``stream``, default ``model``), ``"best"``
        (of ``stream``, default ``best``), a step (of ``stream``, default
        ``model``), a :class:`Checkpoint` or a path inside the save directory.
        ``run`` names the run in error messages.
        """
        where = run if run is not None else self.save_dir
        if isinstance(which, Checkpoint):
            return self._committed_by_path(which.path, where)
        if which == "latest":
            found = self.latest(stream or "model")
            if found is None:
                raise CheckpointNotFoundError(f"stream {stream or 'model'!r} has no checkpoint yet")
            return found
        if which == "best":
            best = self.best(stream or "best")
            if not best:
                raise CheckpointNotFoundError(f"stream {stream or 'best'!r} has no checkpoint yet")
            return best[0]
        if isinstance(which, int) and not isinstance(which, bool):
            name = stream or "model"
            self.policy(name)
            if not 0 <= which <= INT64_MAX:  # no ledger holds it: the driver would raise
                raise InvalidArgumentError(f"step must be from 0 to 2**63 - 1, got {which}")
            with self.db.transaction(read=True) as session:
                found = lookup.committed_at_step(session, self.run_id, name, which, self.save_dir)
            if found is None:
                raise CheckpointNotFoundError(
                    f"stream {name!r} has no committed checkpoint at step {which}"
                )
            return found
        if isinstance(which, (str, os.PathLike)):
            return self._committed_by_path(
                str(which) if is_object_url(which) else Path(which), where
            )
        raise ArgumentTypeError(
            f"which must be 'latest', 'best', a step, a Checkpoint or a path; got {which!r}"
        )

    def _committed_by_path(self, path: Path | str, where: object) -> Checkpoint:
        rel = relative_within(path, self.save_dir)
        found = None
        if rel is not None:
            with self.db.transaction(read=True) as session:
                found = lookup.committed_at_path(session, self.run_id, rel, self.save_dir)
        if found is None:
            raise CheckpointNotFoundError(f"{path} is not a committed checkpoint of run {where}")
        return found

    # ------------------------------------------------------------ history (readers)

    def state_counts(self) -> dict[str, int]:
        with self.db.transaction(read=True) as session:
            result = session.execute(
                select(m.Checkpoint.state, func.count())
                .where(m.Checkpoint.run_id == self.run_id)
                .group_by(m.Checkpoint.state)
            )
            return {state: count for state, count in result}

    def committed_counts(self) -> dict[str, int]:
        """Committed checkpoints per stream, counted by the database (a status of a run
        of 10k checkpoints would otherwise build 10k records to count them)."""
        with self.db.transaction(read=True) as session:
            result = session.execute(
                select(m.Checkpoint.stream, func.count())
                .where(m.Checkpoint.run_id == self.run_id, m.Checkpoint.state == m.COMMITTED)
                .group_by(m.Checkpoint.stream)
            )
            return {stream: count for stream, count in result}

    def attempts(self) -> list[m.Attempt]:
        with self.db.transaction(read=True) as session:
            query = select(m.Attempt).where(m.Attempt.run_id == self.run_id).order_by(m.Attempt.id)
            return list(session.scalars(query))

    def events(self, limit: int = 10) -> list[m.Event]:
        """The newest ``limit`` events, oldest first."""
        with self.db.transaction(read=True) as session:
            query = (
                select(m.Event)
                .where(m.Event.run_id == self.run_id)
                .order_by(m.Event.id.desc())
                .limit(limit)
            )
            return list(reversed(list(session.scalars(query))))

    def events_of(self, *kinds: str) -> list[m.Event]:
        """Every event of these kinds, oldest first (all of them: a run has few)."""
        with self.db.transaction(read=True) as session:
            query = (
                select(m.Event)
                .where(m.Event.run_id == self.run_id, m.Event.kind.in_(kinds))
                .order_by(m.Event.id)
            )
            return list(session.scalars(query))

    def metric_history(self, name: str) -> list[tuple[int, float, int]]:
        """(step, value, attempt id) of one metric, by step then attempt."""
        with self.db.transaction(read=True) as session:
            query = (
                select(m.Metric.step, m.Metric.value, m.Metric.attempt_id)
                .where(m.Metric.run_id == self.run_id, m.Metric.name == name)
                .order_by(m.Metric.step, m.Metric.attempt_id, m.Metric.id)
            )
            return [(s, math.nan if v is None else v, a) for s, v, a in session.execute(query)]

    def metric_names(self) -> list[str]:
        with self.db.transaction(read=True) as session:
            query = select(m.Metric.name).where(m.Metric.run_id == self.run_id).distinct()
            return sorted(session.scalars(query))


def run_sql(db: Ledger, statement: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one SQL statement on a read-only ledger; only a query that returns rows runs.

    A statement that would write is refused by the database itself (SQLite
    ``query_only``, PostgreSQL ``READ ONLY`` transactions); its error comes
    back as :class:`InvalidArgumentError` with the database's first line.
    """
    try:
        with db.transaction() as session:
            # no_parameters: the statement goes to the driver as is, so a literal
            # '%' (LIKE 'latest:%') is not taken for a placeholder by psycopg
            result = session.connection().exec_driver_sql(
                statement, execution_options={"no_parameters": True}
            )
            if not result.returns_rows:
                raise InvalidArgumentError("the statement returned no rows (only queries run)")
            return list(result.keys()), [tuple(row) for row in result.all()]
    except DatabaseError as exc:
        original = exc.original or exc
        message = str(getattr(original, "orig", None) or original).splitlines()[0]
        raise InvalidArgumentError(f"SQL error: {message}") from original
