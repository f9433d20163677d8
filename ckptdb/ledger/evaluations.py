"""Evaluations: values computed for a checkpoint after it was published.

A sidecar evaluator scores each new checkpoint and records the scores here,
next to the checkpoint's row, instead of in a separate tracker. One row per
(checkpoint, evaluator, name); several evaluators may score one checkpoint,
and re-recording a name replaces the earlier value. The view
``checkpoint_evaluations`` joins them with their checkpoints for SQL.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..errors import ArgumentTypeError, CheckpointNotFoundError, InvalidArgumentError
from . import models as m


def checked_values(values: object) -> dict[str, float]:
    """``values`` as names (1-255 characters) to floats; anything else is refused."""
    if not isinstance(values, Mapping):
        raise ArgumentTypeError(f"values must be a dict name -> number, got {values!r}")
    if not values:
        raise InvalidArgumentError("an evaluation needs at least one value")
    checked: dict[str, float] = {}
    for name, value in values.items():
        if not isinstance(name, str) or not 0 < len(name) <= 255:
            raise ArgumentTypeError(f"evaluation names are str of 1-255 characters, got {name!r}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ArgumentTypeError(f"evaluation {name!r} must be a real number, got {value!r}")
        checked[name] = float(value)
    return checked


def record(
    session: Session, run_id: int, checkpoint_id: int, evaluator: str, values: Mapping[str, float]
) -> None:
    """Store ``values`` for the run's checkpoint ``checkpoint_id`` (NaN is stored as NULL)."""
    found = session.get(m.Checkpoint, checkpoint_id)
    if found is None or found.run_id != run_id:
        raise CheckpointNotFoundError(f"checkpoint {checkpoint_id} is not a checkpoint of this run")
    now = m.utcnow()
    rows = [
        {
            "run_id": run_id,
            "checkpoint_id": checkpoint_id,
            "evaluator": evaluator,
            "name": name,
            "value": None if math.isnan(value) else value,
            "recorded_at": now,
        }
        for name, value in values.items()
    ]
    # an upsert on the unique (checkpoint, evaluator, name): concurrent recorders of the
    # same values never collide, the last one wins
    insert: Callable[[Any], Any]  # each dialect's INSERT ... ON CONFLICT
    if session.get_bind().dialect.name == "postgresql":
        # imported here: the PostgreSQL dialect (and asyncio with it) is 25 ms of every
        # cold ``ckptdb`` command on a SQLite ledger otherwise
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    statement = insert(m.Evaluation).values(rows)
    statement = statement.on_conflict_do_update(
        index_elements=["checkpoint_id", "evaluator", "name"],
        set_={"value": statement.excluded.value, "recorded_at": statement.excluded.recorded_at},
    )
    session.execute(statement)


def of_checkpoint(session: Session, checkpoint_id: int) -> list[m.Evaluation]:
    query = select(m.Evaluation).where(m.Evaluation.checkpoint_id == checkpoint_id)
    return list(session.scalars(query.order_by(m.Evaluation.evaluator, m.Evaluation.name)))


def best(
    session: Session,
    run_id: int,
    name: str,
    mode: Literal["min", "max"],
    *,
    evaluator: str | None = None,
    stream: str | None = None,
    states: tuple[str, ...] = (m.COMMITTED,),
) -> list[tuple[m.Checkpoint, float, str]]:
    """Checkpoints by their evaluated ``name``, best first: (row, value, evaluator).

    Only checkpoints in ``states`` (committed: the ones that can still be
    loaded); a NULL (NaN) value never ranks. Ties go to the earlier step. A
    checkpoint several evaluators scored appears once, with its best value.
    """
    order = m.Evaluation.value.desc() if mode == "max" else m.Evaluation.value.asc()
    query = (
        select(m.Checkpoint, m.Evaluation.value, m.Evaluation.evaluator)
        .join(m.Evaluation, m.Evaluation.checkpoint_id == m.Checkpoint.id)
        .where(
            m.Evaluation.run_id == run_id,
            m.Evaluation.name == name,
            m.Evaluation.value.is_not(None),
            m.Checkpoint.state.in_(states),
        )
        .order_by(order, m.Checkpoint.step, m.Checkpoint.id)
    )
    if evaluator is not None:
        query = query.where(m.Evaluation.evaluator == evaluator)
    if stream is not None:
        query = query.where(m.Checkpoint.stream == stream)
    found: list[tuple[m.Checkpoint, float, str]] = []
    seen: set[int] = set()
    for row, value, who in session.execute(query):
        if row.id not in seen and value is not None:
            seen.add(row.id)
            found.append((row, float(value), who))
    return found


def last_evaluated_id(session: Session, run_id: int, evaluator: str, stream: str) -> int | None:
    """The newest checkpoint of ``stream`` that ``evaluator`` recorded anything for: where a
    restarted ``ckptdb follow`` continues."""
    query = (
        select(func.max(m.Evaluation.checkpoint_id))
        .join(m.Checkpoint, m.Checkpoint.id == m.Evaluation.checkpoint_id)
        .where(
            m.Evaluation.run_id == run_id,
            m.Evaluation.evaluator == evaluator,
            m.Checkpoint.stream == stream,
        )
    )
    found = session.scalar(query)
    return int(found) if found is not None else None
