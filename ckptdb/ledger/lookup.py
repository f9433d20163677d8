"""The committed row a load names, read at the driver level: the hot path of every load.

Why not the ORM here: resolving ``load(step)`` or ``load("latest")`` through it cost
~0.7 ms (building the statement, its cache key, loading the row into an object),
about as much as unpickling a 100 MB checkpoint. Each lookup here is one plain
SQL statement run through :func:`~ckptdb.ledger.boundary_rows.run`, inside the
caller's transaction, and its row becomes a :class:`~ckptdb.record.Checkpoint`
exactly as :func:`~ckptdb.ledger.rows.to_record` makes one: each column goes
through the result processor of its type in :mod:`~ckptdb.ledger.models` (a
timestamp comes back aware, on SQLite parsed from its text), so both paths
answer the same. Nothing is cached between calls: the ledger stays the only truth.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session

from ..record import CHECKPOINT_FIELDS, Checkpoint
from . import models as m
from .boundary_rows import run
from .rows import latest_pointer

_COLUMNS = CHECKPOINT_FIELDS
_SELECT = "SELECT " + ", ".join(f"c.{name}" for name in _COLUMNS) + " FROM checkpoints c"
_NEWEST = " ORDER BY c.id DESC LIMIT 1"
_BY_STEP = _SELECT + " WHERE c.run_id = ? AND c.state = ? AND c.stream = ? AND c.step = ?" + _NEWEST
_BY_PATH = _SELECT + " WHERE c.run_id = ? AND c.state = ? AND c.path = ?" + _NEWEST
_LATEST = (
    _SELECT + " JOIN pointers p ON p.checkpoint_id = c.id"
    " WHERE p.run_id = ? AND p.name = ? AND c.state = ?"
)


def committed_at_step(
    session: Session, run_id: int, stream: str, step: int, save_dir: Path
) -> Checkpoint | None:
    """The newest committed row of ``stream`` at ``step`` (what
    ``RunQueries.find_committed(stream=..., step=...)`` answers)."""
    return _one(session, _BY_STEP, (run_id, m.COMMITTED, stream, step), save_dir)


def committed_at_path(session: Session, run_id: int, rel: str, save_dir: Path) -> Checkpoint | None:
    """The newest committed row whose ``path`` is ``rel`` (relative to ``save_dir``)."""
    return _one(session, _BY_PATH, (run_id, m.COMMITTED, rel), save_dir)


def latest(session: Session, run_id: int, stream: str, save_dir: Path) -> Checkpoint | None:
    """The row ``latest:<stream>`` points at, if it is committed (what
    :func:`~ckptdb.ledger.rows.latest_row` answers): one join, not two lookups."""
    return _one(session, _LATEST, (run_id, latest_pointer(stream), m.COMMITTED), save_dir)


def _one(session: Session, sql: str, params: tuple[Any, ...], save_dir: Path) -> Checkpoint | None:
    result = run(session, sql, params)
    if not result.rows:
        return None
    processors = _processors(session.get_bind().dialect, result.types)
    values = dict(zip(_COLUMNS, _processed(result.rows[0], processors), strict=True))
    return _record(values, save_dir)


def _processed(
    row: tuple[Any, ...], processors: tuple[Callable[[Any], Any] | None, ...]
) -> list[Any]:
    return [value if p is None else p(value) for value, p in zip(row, processors, strict=True)]


@functools.lru_cache(maxsize=32)
def _processors(
    dialect: Dialect, codes: tuple[Any, ...]
) -> tuple[Callable[[Any], Any] | None, ...]:
    """Each selected column's result processor on ``dialect`` for the driver's type
    ``codes`` (None: the driver's value is the ORM's): what the ORM applies to the
    same column of a loaded row."""
    table = m.Checkpoint.__table__
    return tuple(
        table.c[name].type.dialect_impl(dialect).result_processor(dialect, code)
        for name, code in zip(_COLUMNS, codes, strict=True)
    )


def _record(values: dict[str, Any], save_dir: Path) -> Checkpoint:
    """:func:`~ckptdb.ledger.rows.to_record` of the same row (``path`` made absolute)."""
    return Checkpoint(
        stream=values["stream"],
        step=values["step"],
        path=save_dir / values["path"],
        size=values["size"],
        hash=values["hash"],
        metric=values["metric"],
        state=values["state"],
        committed_at=values["committed_at"],
        id=values["id"],
        attempt_id=values["attempt_id"],
        metrics=json.loads(values["metrics"]) if values["metrics"] else {},
        world_size=values["world_size"],
    )
