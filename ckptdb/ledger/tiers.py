"""The ``tiers`` table: a run's registered second tier, and the holds it puts on
local retention.

A replicator registers its tier when it opens: where the copies go, which
streams it copies, and each stream's retention there. From then on a local
checkpoint of a copied stream that retention evicts keeps its file until its
copy is whole: the commit that evicts it also pins it, with a pin whose holder
is the tier's (:func:`holder`) and which never expires, and the replicator
releases that pin in the transaction that records the copy ``replicated``.
Pins are what every remover of evicted files already obeys (the next commit,
``gc``, reconcile, ``close``), so the hold needs no new rule anywhere: the row
is ``deleting`` (out of its stream, as retention decided) and the file stays,
visible in ``ckptdb pins``, until the copy exists.

Only a copy that was made releases its hold: a checkpoint whose copies keep
failing keeps its local file (``ckptdb replicate --retry-failed`` tries again;
:func:`detach` gives the tier up and releases every hold).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from ..policies import PolicyRecord
from . import models as m
from .boundary_rows import MAX_BOUND, batches, fetch, run, stamp
from .held import connection_of

#: A hold's pin lasts until its copy is made (or the tier is detached), not a lease.
FOREVER = dt.datetime(9999, 1, 1, tzinfo=dt.timezone.utc)
#: Replica states that release a checkpoint's hold: its copy was made (and maybe since
#: removed by the tier's own retention).
COPIED_STATES = ("replicated", "deleting", "deleted")


def holder(tier: str) -> str:
    """The holder name of the pins a tier holds on local files waiting for their copy."""
    return f"ckptdb.replication:{tier}"


@dataclass(frozen=True)
class Registration:
    """A tier as registered for a run (a row of the ledger's ``tiers`` table).

    Attributes:
        tier: The tier's name (``remote``).
        location: Where its copies go (the replicator's URL).
        streams: The streams it copies; None: every stream.
        policies: Each stream's retention on that tier, as stored.
        registered_at: When the replicator registered it (timezone-aware UTC).
    """

    tier: str
    location: str
    streams: tuple[str, ...] | None
    policies: dict[str, PolicyRecord] = field(default_factory=dict)
    registered_at: dt.datetime | None = None

    def covers(self, stream: str) -> bool:
        """Whether the tier copies ``stream``.

        Args:
            stream: A stream name.

        Returns:
            True when it copies every stream or names this one.
        """
        return self.streams is None or stream in self.streams


def register(
    session: Session,
    run_id: int,
    tier: str,
    location: str,
    streams: Sequence[str] | None,
    policies: Mapping[str, PolicyRecord],
) -> Registration:
    """Record (or replace) the run's ``tier``; the holds of streams it no longer copies
    are released (their files go at the writer's next commit, ``gc`` or reconcile)."""
    row = session.scalars(
        select(m.Tier).where(m.Tier.run_id == run_id, m.Tier.tier == tier).with_for_update()
    ).first()
    if row is None:
        row = m.Tier(run_id=run_id, tier=tier)
        session.add(row)
    row.location = location
    row.streams = None if streams is None else json.dumps(sorted(streams))
    stored = {name: asdict(record) for name, record in sorted(policies.items())}
    row.policies = json.dumps(stored) if stored else None
    row.registered_at = m.utcnow()
    session.flush()
    registration = _registration(row)
    held = _held(session, run_id, tier)
    release(session, [i for i, stream in held if not registration.covers(stream)], tier)
    return registration


def registrations(session: Session, run_id: int) -> list[Registration]:
    """The run's registered tiers."""
    found = session.scalars(select(m.Tier).where(m.Tier.run_id == run_id).order_by(m.Tier.tier))
    return [_registration(row) for row in found]


def detach(session: Session, run_id: int, tier: str) -> int:
    """Forget the run's ``tier``: local retention stops waiting for its copies. Every
    hold it had is released; their number."""
    session.scalars(  # a commit adding a hold holds the row FOR SHARE: it is waited for
        select(m.Tier.id).where(m.Tier.run_id == run_id, m.Tier.tier == tier).with_for_update()
    ).first()
    held = [i for i, _ in _held(session, run_id, tier)]
    release(session, held, tier)
    session.execute(delete(m.Tier).where(m.Tier.run_id == run_id, m.Tier.tier == tier))
    return len(held)


def release(session: Session, checkpoint_ids: Sequence[int], tier: str) -> None:
    """Release ``tier``'s holds on these checkpoints (their copy is made, or no longer
    wanted): the writer removes the files of those it evicted, as for any released pin."""
    for part in batches(checkpoint_ids, MAX_BOUND):
        session.execute(
            update(m.Pin)
            .where(m.Pin.checkpoint_id.in_(list(part)), m.Pin.holder == holder(tier))
            .where(m.Pin.released_at.is_(None))
            .values(released_at=m.utcnow())
        )


def waiting(session: Session, run_id: int) -> list[tuple[m.Checkpoint, str]]:
    """Evicted checkpoints whose files wait for their copy, with the tier they wait for."""
    query = (
        select(m.Checkpoint, m.Pin.holder)
        .join(m.Pin, m.Pin.checkpoint_id == m.Checkpoint.id)
        .where(m.Checkpoint.run_id == run_id, m.Checkpoint.state == m.DELETING)
        .where(m.Pin.holder.like(holder("%")), m.Pin.released_at.is_(None))
        .order_by(m.Checkpoint.id)
    )
    return [(row, name.split(":", 1)[1]) for row, name in session.execute(query)]


def _held(session: Session, run_id: int, tier: str) -> list[tuple[int, str]]:
    """(checkpoint id, stream) of every live hold of ``tier``."""
    query = (
        select(m.Checkpoint.id, m.Checkpoint.stream)
        .join(m.Pin, m.Pin.checkpoint_id == m.Checkpoint.id)
        .where(m.Pin.run_id == run_id, m.Pin.holder == holder(tier))
        .where(m.Pin.released_at.is_(None))
    )
    return [(int(i), str(s)) for i, s in session.execute(query)]


def _registration(row: m.Tier) -> Registration:
    streams = None if row.streams is None else tuple(json.loads(row.streams))
    stored = json.loads(row.policies) if row.policies else {}
    policies = {name: PolicyRecord(**record) for name, record in stored.items()}
    return Registration(row.tier, row.location, streams, policies, row.registered_at)


# ------------------------------------------------------------- the boundary's part


def hold_for_copy(
    session: Session, run_id: int, evicted: Sequence[int], now: dt.datetime
) -> set[int]:
    """Pin each of the just-evicted checkpoints ``evicted`` that a registered tier copies
    and that has no copy there yet, in the evicting transaction; their ids.

    Driver-level statements, run only when the boundary's pin check found a tier
    registered (see :func:`~ckptdb.ledger.boundary_rows.pinned_ids`)."""
    if not evicted:
        return set()
    # FOR SHARE: a registration changed or removed meanwhile (register, detach lock the
    # row FOR UPDATE) is waited for, then read as it is: no hold added after a detach
    # released the tier's holds, or for a stream it no longer copies
    lock = " FOR SHARE" if connection_of(session).dialect.name == "postgresql" else ""
    tiers = fetch(
        session, f"SELECT tier, streams, location FROM tiers WHERE run_id = ?{lock}", (run_id,)
    )
    if not tiers:
        return set()
    # a copy counts only under the tier's registered destination (a --to changed since
    # leaves the old destination's copies out: the new one has none yet)
    heads = {str(tier): f"{str(location).rstrip('/')}/" for tier, _, location in tiers}
    streams: dict[int, str] = {}
    copied: set[tuple[int, str]] = set()
    for part in batches(evicted, MAX_BOUND - len(COPIED_STATES)):
        marks = ", ".join(["?"] * len(part))
        sql = f"SELECT id, stream FROM checkpoints WHERE id IN ({marks})"
        streams.update((int(i), str(s)) for i, s in fetch(session, sql, tuple(part)))
        states = ", ".join(["?"] * len(COPIED_STATES))
        sql = (
            f"SELECT checkpoint_id, tier, location FROM replicas"
            f" WHERE checkpoint_id IN ({marks}) AND state IN ({states})"
        )
        copied.update(
            (int(i), str(t))
            for i, t, where in fetch(session, sql, (*part, *COPIED_STATES))
            if str(t) in heads and str(where).startswith(heads[str(t)])
        )
    holds = []
    for tier, listed, _ in tiers:
        covered = None if listed is None else set(json.loads(listed))
        for checkpoint_id, stream in streams.items():
            if (covered is None or stream in covered) and (checkpoint_id, tier) not in copied:
                holds.append((checkpoint_id, str(tier)))
    if holds:
        at, until = stamp(session, now), stamp(session, FOREVER)
        rows = [(run_id, i, holder(t), at, until) for i, t in holds]
        run(
            session,
            "INSERT INTO pins (run_id, checkpoint_id, holder, created_at, expires_at)"
            " VALUES (?, ?, ?, ?, ?)",
            rows,
        )
    return {i for i, _ in holds}
