"""Pins: readers' leases that keep an evicted checkpoint's file on disk.

A reader pins a *committed* checkpoint in a short transaction of its own (no
writer lock). Retention still evicts a pinned checkpoint from its stream, but
its row stays ``deleting`` and its file stays on disk: the visible
intermediate state. The writer removes the file once no pin on it is live,
at its next commit, ``gc`` or reconcile. A pin is live while it is not
released and its lease has not expired (``expires_at``; the reader renews it
while it holds the pin), so a crashed reader never pins forever.

Pinning and evicting never race: the pin's transaction locks the checkpoint
row (PostgreSQL ``FOR SHARE``; SQLite runs one writing transaction at a
time) and pins only a ``committed`` row, while the eviction marks the row
``deleting`` first and then reads the live pins in the same transaction.
Either the pin commits first and the eviction sees it, or the eviction
commits first and the pin is refused. Lease times are the clients' clocks:
hosts that pin and evict must agree on the time to well within a TTL.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, delete, select, update
from sqlalchemy.orm import Session

from ..errors import CheckpointNotFoundError
from . import models as m
from .boundary_rows import MAX_BOUND, batches


def _live(now: dt.datetime) -> Any:
    return and_(m.Pin.released_at.is_(None), m.Pin.expires_at > now)


def add(
    session: Session, run_id: int, checkpoint_id: int, holder: str, ttl: float
) -> tuple[int, dt.datetime]:
    """Pin a committed checkpoint of the run; its id and expiry. Refused if it is not
    committed (already evicted, lost, corrupt) or not the run's."""
    found = session.scalars(
        select(m.Checkpoint)
        .where(m.Checkpoint.id == checkpoint_id, m.Checkpoint.run_id == run_id)
        .with_for_update(read=True)
    ).first()
    if found is None or found.state != m.COMMITTED:
        state = "not in this run" if found is None else found.state
        raise CheckpointNotFoundError(
            f"checkpoint {checkpoint_id} cannot be pinned: it is {state}, not committed"
        )
    now = m.utcnow()
    pin = m.Pin(
        run_id=run_id,
        checkpoint_id=checkpoint_id,
        holder=holder[:255],
        created_at=now,
        expires_at=now + dt.timedelta(seconds=ttl),
    )
    session.add(pin)
    session.flush()
    return pin.id, pin.expires_at


def renew(session: Session, pin_id: int, ttl: float) -> dt.datetime | None:
    """Extend a live pin's lease from now; None if it is gone, released or already
    expired (the lease was lost: the writer may have removed the file meanwhile)."""
    now = m.utcnow()
    expires = now + dt.timedelta(seconds=ttl)
    done = session.execute(
        update(m.Pin).where(m.Pin.id == pin_id, _live(now)).values(expires_at=expires)
    )
    return expires if getattr(done, "rowcount", 0) == 1 else None


def release(session: Session, pin_id: int) -> None:
    session.execute(
        update(m.Pin)
        .where(m.Pin.id == pin_id, m.Pin.released_at.is_(None))
        .values(released_at=m.utcnow())
    )


def pinned_ids(session: Session, run_id: int, ids: Sequence[int], now: dt.datetime) -> set[int]:
    """Which of the checkpoints ``ids`` have a live pin (asked in batches: a gc or
    reconcile after a large eviction may hold more ids than a statement may bind)."""
    held: set[int] = set()
    for part in batches(ids, MAX_BOUND - 4):
        query = select(m.Pin.checkpoint_id).where(
            m.Pin.run_id == run_id, m.Pin.checkpoint_id.in_(list(part)), _live(now)
        )
        held.update(session.scalars(query))
    return held


def live_pinned(session: Session, run_id: int, now: dt.datetime) -> set[int]:
    """Every checkpoint of the run with a live pin."""
    return set(
        session.scalars(select(m.Pin.checkpoint_id).where(m.Pin.run_id == run_id, _live(now)))
    )


def held_back(session: Session, run_id: int) -> list[m.Checkpoint]:
    """``deleting`` rows that have pins (live or not): evictions that waited for a pin."""
    any_pin = select(m.Pin.id).where(m.Pin.checkpoint_id == m.Checkpoint.id)
    query = select(m.Checkpoint).where(
        m.Checkpoint.run_id == run_id, m.Checkpoint.state == m.DELETING, any_pin.exists()
    )
    return list(session.scalars(query))


def drop(session: Session, checkpoint_ids: Sequence[int]) -> None:
    """Forget the pins of checkpoints whose files are being removed (in batches, as
    :func:`pinned_ids`)."""
    for part in batches(checkpoint_ids, MAX_BOUND):
        session.execute(delete(m.Pin).where(m.Pin.checkpoint_id.in_(list(part))))


def clear_stale(session: Session, run_id: int, now: dt.datetime) -> int:
    """Delete released and expired pins, except those still holding back a file
    (a ``deleting`` row: the next commit or reconcile removes it, then them)."""
    waiting = select(m.Checkpoint.id).where(
        m.Checkpoint.run_id == run_id, m.Checkpoint.state == m.DELETING
    )
    done = session.execute(
        delete(m.Pin).where(
            m.Pin.run_id == run_id,
            ~_live(now),
            m.Pin.checkpoint_id.not_in(waiting),
        )
    )
    return int(getattr(done, "rowcount", 0) or 0)


def listing(session: Session, run_id: int) -> list[tuple[m.Pin, m.Checkpoint]]:
    """The run's pins with their checkpoints, oldest first."""
    query = (
        select(m.Pin, m.Checkpoint)
        .join(m.Checkpoint, m.Checkpoint.id == m.Pin.checkpoint_id)
        .where(m.Pin.run_id == run_id)
        .order_by(m.Pin.id)
    )
    return [(pin, row) for pin, row in session.execute(query)]
