"""The ``replicas`` table: each copy of a checkpoint on another tier, and its state.

A replica row is the marker of a copy, as a checkpoint row is of a checkpoint:
the replicator records ``uploading`` (with the copy's location) before the
first byte leaves, and ``replicated`` only after every object of the copy is
complete and its size and hash are the checkpoint row's. A copy whose
replicator died mid-way stays ``uploading`` until the next replicator removes
its objects and marks it ``failed``; so a copy is never counted twice, and
never counted before it is whole.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import and_, exists, func, or_, select, update
from sqlalchemy.orm import Session

from ..record import Replica
from . import models as m

UPLOADING = "uploading"
REPLICATED = "replicated"
FAILED = "failed"
#: A copy the tier's retention removes: ``deleting`` before its objects go, ``deleted``
#: after (a removal cut short is finished by the next pass).
DELETING = "deleting"
DELETED = "deleted"
REPLICA_STATES = (UPLOADING, REPLICATED, FAILED, DELETING, DELETED)
#: The error of a copy whose replicator stopped mid-way (not the copy's fault: it does
#: not count towards the failures after which a checkpoint is no longer tried).
INTERRUPTED = "interrupted: its replicator stopped mid-copy"


def add(
    session: Session, run_id: int, checkpoint_id: int, tier: str, place: Callable[[int], str]
) -> int:
    """The intent: an ``uploading`` row naming where the copy goes (``place(id)``: its
    location is named by the row's own id), in the caller's transaction; its id."""
    row = m.Replica(
        run_id=run_id,
        checkpoint_id=checkpoint_id,
        tier=tier,
        location="",
        state=UPLOADING,
        started_at=m.utcnow(),
    )
    session.add(row)
    session.flush()
    row.location = place(row.id)
    session.flush()
    return row.id


def finish(
    session: Session,
    replica_id: int,
    checkpoint_id: int,
    size: int,
    digest: str,
    manifest: dict[str, Any],
) -> bool:
    """Mark a whole, verified copy ``replicated``; whether it was (still ``uploading``).

    The checkpoint's row is locked first (PostgreSQL; SQLite runs one writing
    transaction at a time), as a commit that evicts it locks it: either that commit
    sees this copy and holds nothing back, or its hold is committed before the
    caller releases the checkpoint's holds (see ledger.tiers)."""
    session.scalars(  # FOR NO KEY UPDATE: as the commit's UPDATE of the row, not a pin's
        select(m.Checkpoint.id)
        .where(m.Checkpoint.id == checkpoint_id)
        .with_for_update(key_share=True)
    ).first()
    done = session.execute(
        update(m.Replica)
        .where(m.Replica.id == replica_id, m.Replica.state == UPLOADING)
        .values(
            state=REPLICATED,
            size=size,
            hash=digest,
            manifest=json.dumps(manifest),
            finished_at=m.utcnow(),
        )
    )
    return getattr(done, "rowcount", 0) == 1


def fail(session: Session, replica_id: int, error: str) -> None:
    session.execute(
        update(m.Replica)
        .where(m.Replica.id == replica_id, m.Replica.state == UPLOADING)
        .values(state=FAILED, error=error, finished_at=m.utcnow())
    )


def mark_swept(session: Session, replica_id: int, when: dt.datetime) -> None:
    session.execute(update(m.Replica).where(m.Replica.id == replica_id).values(swept_at=when))


def unfinished(session: Session, run_id: int, tier: str) -> list[m.Replica]:
    """Copies left ``uploading`` (by a replicator that stopped mid-way)."""
    return list(
        session.scalars(
            select(m.Replica)
            .where(m.Replica.run_id == run_id, m.Replica.tier == tier)
            .where(m.Replica.state == UPLOADING)
            .order_by(m.Replica.id)
        )
    )


def _under(within: str) -> Any:
    """A copy's location starts with ``within``, compared byte for byte (``LIKE`` would
    ignore case on SQLite, and treat ``_`` and ``%`` as patterns)."""
    return func.substr(m.Replica.location, 1, len(within)) == within


def to_copy(
    session: Session,
    run_id: int,
    tier: str,
    streams: Sequence[str] | None,
    max_failures: int | None,
    holder: str,
    within: str,
) -> list[m.Checkpoint]:
    """Checkpoints to copy to ``tier``, oldest first: committed ones, and evicted ones
    whose file the tier holds (``holder``'s live pin), with no copy made or under
    way there, failed fewer than ``max_failures`` times (None: whatever the count).

    Only copies whose location starts with ``within`` (the destination's URL prefix)
    count: after the destination changed, every checkpoint is copied to the new one."""
    live = exists().where(
        m.Replica.checkpoint_id == m.Checkpoint.id,
        m.Replica.tier == tier,
        m.Replica.state.in_((UPLOADING, REPLICATED, DELETING, DELETED)),
        _under(within),
    )
    held = exists().where(
        m.Pin.checkpoint_id == m.Checkpoint.id,
        m.Pin.holder == holder,
        m.Pin.released_at.is_(None),
    )
    failures = (
        select(func.count(m.Replica.id))
        .where(
            and_(
                m.Replica.checkpoint_id == m.Checkpoint.id,
                m.Replica.tier == tier,
                m.Replica.state == FAILED,
                m.Replica.error != INTERRUPTED,
                _under(within),
            )
        )
        .scalar_subquery()
    )
    query = (
        select(m.Checkpoint)
        .where(m.Checkpoint.run_id == run_id)
        .where(or_(m.Checkpoint.state == m.COMMITTED, and_(m.Checkpoint.state == m.DELETING, held)))
        .where(~live)
        .order_by(m.Checkpoint.id)
    )
    if max_failures is not None:
        query = query.where(failures < max_failures)
    if streams is not None:
        query = query.where(m.Checkpoint.stream.in_(list(streams)))
    return list(session.scalars(query))


def whole_copies(
    session: Session, run_id: int, tier: str, stream: str
) -> list[tuple[m.Checkpoint, m.Replica]]:
    """The ``replicated`` copies on ``tier`` of ``stream``'s checkpoints, whatever the
    checkpoints' local state (a copy outlives its local file)."""
    found = session.execute(
        select(m.Checkpoint, m.Replica)
        .join(m.Replica, m.Replica.checkpoint_id == m.Checkpoint.id)
        .where(m.Checkpoint.run_id == run_id, m.Checkpoint.stream == stream)
        .where(m.Replica.tier == tier, m.Replica.state == REPLICATED)
        .order_by(m.Replica.id)
    ).all()
    return [(row, replica) for row, replica in found]


def in_state(session: Session, run_id: int, tier: str, state: str) -> list[m.Replica]:
    """The run's copies on ``tier`` in ``state``, oldest first."""
    return list(
        session.scalars(
            select(m.Replica)
            .where(m.Replica.run_id == run_id, m.Replica.tier == tier, m.Replica.state == state)
            .order_by(m.Replica.id)
        )
    )


def mark_deleting(session: Session, replica_ids: Sequence[int]) -> None:
    """Copies the tier's retention removes: recorded before any object goes."""
    if replica_ids:
        session.execute(
            update(m.Replica)
            .where(m.Replica.id.in_(list(replica_ids)), m.Replica.state == REPLICATED)
            .values(state=DELETING)
        )


def mark_deleted(session: Session, replica_id: int) -> None:
    session.execute(
        update(m.Replica)
        .where(m.Replica.id == replica_id, m.Replica.state == DELETING)
        .values(state=DELETED, error=None)
    )


def mark_bad_copy(session: Session, replica_id: int, error: str) -> None:
    """A ``replicated`` copy found not to match when it was read back: ``failed``."""
    session.execute(
        update(m.Replica)
        .where(m.Replica.id == replica_id, m.Replica.state == REPLICATED)
        .values(state=FAILED, error=f"read back and refused: {error}")
    )


def state_of(session: Session, replica_id: int) -> str | None:
    row = session.get(m.Replica, replica_id)
    return None if row is None else row.state


def note_error(session: Session, replica_id: int, error: str) -> None:
    session.execute(update(m.Replica).where(m.Replica.id == replica_id).values(error=error))


def of_run(session: Session, run_id: int, tier: str | None = None) -> list[m.Replica]:
    """Every replica row of the run (of ``tier``), oldest first."""
    query = select(m.Replica).where(m.Replica.run_id == run_id)
    if tier is not None:
        query = query.where(m.Replica.tier == tier)
    return list(session.scalars(query.order_by(m.Replica.id)))


def replicated(session: Session, checkpoint_id: int, tier: str, within: str) -> m.Replica | None:
    """The checkpoint's whole copy on ``tier`` whose location starts with ``within``
    (a destination's URL prefix), if any."""
    return session.scalars(
        select(m.Replica)
        .where(m.Replica.checkpoint_id == checkpoint_id, m.Replica.tier == tier)
        .where(m.Replica.state == REPLICATED)
        .where(_under(within))
        .order_by(m.Replica.id.desc())
        .limit(1)
    ).first()


def restorable(
    session: Session,
    run_id: int,
    tier: str,
    within: str,
    *,
    newest_only: bool,
    evicted: bool = False,
) -> list[tuple[m.Checkpoint, m.Replica]]:
    """Checkpoints that may need bringing back (committed, lost or corrupt; ``evicted``:
    those the local window dropped too) with their whole copy on ``tier`` under
    ``within`` (a destination's URL prefix), newest first in each stream;
    ``newest_only``: one per stream."""
    states = (m.COMMITTED, m.LOST, m.CORRUPT) + ((m.DELETED,) if evicted else ())
    found = session.execute(
        select(m.Checkpoint, m.Replica)
        .join(m.Replica, m.Replica.checkpoint_id == m.Checkpoint.id)
        .where(m.Checkpoint.run_id == run_id)
        .where(m.Checkpoint.state.in_(states))
        .where(m.Replica.tier == tier, m.Replica.state == REPLICATED)
        .where(_under(within))
        .order_by(m.Checkpoint.stream, m.Checkpoint.id.desc(), m.Replica.id.desc())
    ).all()
    chosen: list[tuple[m.Checkpoint, m.Replica]] = []
    seen: set[Any] = set()
    for row, replica in found:
        key = row.stream if newest_only else row.id
        if key not in seen:
            seen.add(key)
            chosen.append((row, replica))
    return chosen


def to_record(session: Session, row: m.Replica) -> Replica:
    """The public view of a replica row (with its checkpoint's stream and step)."""
    checkpoint = session.get(m.Checkpoint, row.checkpoint_id)
    assert checkpoint is not None
    return Replica(
        checkpoint_id=row.checkpoint_id,
        stream=checkpoint.stream,
        step=checkpoint.step,
        tier=row.tier,
        location=row.location,
        state=row.state,
        size=row.size,
        hash=row.hash,
        error=row.error,
        id=row.id,
    )
