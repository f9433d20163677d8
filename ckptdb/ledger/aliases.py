"""Derived-alias rows: which names a run's integration asked ckptdb to keep pointed.

The ``aliases`` table says what each alias should name (the latest committed
checkpoint of its stream), never what it names now: the disk is looked at by
the protocol (:mod:`ckptdb.protocol.aliases`), after the commit. These are
the statements, inside the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ..record import Checkpoint, DerivedAlias
from . import models as m
from . import rows


def registered(session: Session, run_id: int) -> list[DerivedAlias]:
    """The run's aliases, by path."""
    query = select(m.Alias).where(m.Alias.run_id == run_id).order_by(m.Alias.path)
    return [DerivedAlias(a.path, a.stream, a.kind) for a in session.scalars(query)]


def register(
    session: Session, run_id: int, aliases: Iterable[DerivedAlias], *, replace: bool
) -> bool:
    """Record ``aliases`` (a path already registered takes the new stream and kind);
    with ``replace`` every other alias of the run is forgotten. Whether anything changed."""
    wanted = {a.path: a for a in aliases}
    known = {a.path: a for a in registered(session, run_id)}
    gone = [p for p in known if p not in wanted] if replace else []
    if gone:
        session.execute(delete(m.Alias).where(m.Alias.run_id == run_id, m.Alias.path.in_(gone)))
    changed = bool(gone)
    for path, alias in wanted.items():
        if known.get(path) == alias:
            continue
        changed = True
        row = session.get(m.Alias, (run_id, path))
        if row is None:
            session.add(m.Alias(run_id=run_id, path=path, stream=alias.stream, kind=alias.kind))
        else:
            row.stream, row.kind = alias.stream, alias.kind
    return changed


def latest_of(
    session: Session,
    run_id: int,
    streams: Iterable[str],
    save_dir: Path,
    chosen: Mapping[str, int | None] | None = None,
) -> dict[str, Checkpoint | None]:
    """The checkpoint each alias of ``streams`` should name: the stream's latest
    committed one (``chosen``: the ids a dry run would point ``latest`` at instead)."""
    found: dict[str, Checkpoint | None] = {}
    for stream in dict.fromkeys(streams):
        if chosen is not None:
            ident = chosen.get(stream)
            row = session.get(m.Checkpoint, ident) if ident is not None else None
        else:
            row = rows.latest_row(session, run_id, stream)
        found[stream] = rows.to_record(row, save_dir) if row is not None else None
    return found
