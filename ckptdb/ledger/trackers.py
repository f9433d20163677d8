"""Trackers: where a follower mirrors a run (MLflow, W&B) and how far it got.

One row per (run, kind, target). The follower reads its row at the start of
each pass and writes it back after each step it mirrored, so a follower
restarted later continues from there: its cursor is the id of the last
metric point mirrored (metric ids only grow), and ``mirrored`` records the
checkpoints logged and the aliases set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from . import models as m


@dataclass
class TrackerState:
    """A tracker row, as the follower works with it."""

    id: int
    external_id: str | None
    metric_cursor: int
    #: checkpoint id (as text) -> what was logged for it (stream, step, where, version)
    logged: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: alias name -> checkpoint id it was set to
    aliases: dict[str, int] = field(default_factory=dict)
    #: checkpoint id (as text) -> what was logged for it, and the state it left in
    evicted: dict[str, dict[str, Any]] = field(default_factory=dict)


def claim(session: Session, run_id: int, kind: str, target: str) -> TrackerState:
    """The run's row for this tracker, created at the first follow."""
    row = session.scalars(
        select(m.Tracker).where(
            m.Tracker.run_id == run_id, m.Tracker.kind == kind, m.Tracker.target == target
        )
    ).one_or_none()
    if row is None:
        row = m.Tracker(
            run_id=run_id,
            kind=kind,
            target=target,
            external_id=None,
            metric_cursor=0,
            mirrored=json.dumps({"logged": {}, "aliases": {}, "evicted": {}}),
            updated_at=m.utcnow(),
        )
        session.add(row)
        session.flush()
    mirrored = json.loads(row.mirrored)
    return TrackerState(
        row.id,
        row.external_id,
        row.metric_cursor,
        mirrored["logged"],
        mirrored["aliases"],
        mirrored.get("evicted", {}),
    )


def save(session: Session, state: TrackerState) -> None:
    row = session.get(m.Tracker, state.id)
    assert row is not None
    row.external_id = state.external_id
    row.metric_cursor = state.metric_cursor
    row.mirrored = json.dumps(
        {"logged": state.logged, "aliases": state.aliases, "evicted": state.evicted},
        sort_keys=True,
    )
    row.updated_at = m.utcnow()


@dataclass(frozen=True)
class Point:
    """One metric point of the ledger."""

    id: int
    name: str
    step: int
    value: float | None
    wall_time: float


def metrics_after(session: Session, run_id: int, cursor: int, limit: int) -> list[Point]:
    """The run's metric points after ``cursor`` (an id), oldest first, at most ``limit``."""
    query = (
        select(m.Metric.id, m.Metric.name, m.Metric.step, m.Metric.value, m.Metric.wall_time)
        .where(m.Metric.run_id == run_id, m.Metric.id > cursor)
        .order_by(m.Metric.id)
        .limit(limit)
    )
    return [Point(*row) for row in session.execute(query)]
