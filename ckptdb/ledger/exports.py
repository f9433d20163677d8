"""Exports: derivatives of a checkpoint written outside the run, one row each.

A row is written in one transaction once the export's directory is complete
and in place, so a row always names a whole export. Exporting again to a
path an earlier export of the run named (its directory since removed)
replaces that row in the same transaction: a path names one export.
"""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ..record import Export, ExportedFile
from . import models as m


def record(
    session: Session,
    run_id: int,
    checkpoint_id: int,
    fmt: str,
    path: Path,
    files: list[ExportedFile],
    size: int,
    digest: str,
    tensors: int,
) -> int:
    """Store a complete export of the run's checkpoint; its id."""
    session.execute(delete(m.Export).where(m.Export.run_id == run_id, m.Export.path == str(path)))
    row = m.Export(
        run_id=run_id,
        checkpoint_id=checkpoint_id,
        format=fmt,
        path=str(path),
        size=size,
        hash=digest,
        manifest=json.dumps([[f.name, f.size, f.hash] for f in files]),
        tensors=tensors,
        created_at=m.utcnow(),
    )
    session.add(row)
    session.flush()
    return row.id


def of_run(session: Session, run_id: int, checkpoint_id: int | None = None) -> list[Export]:
    """The run's exports (of one checkpoint), oldest first."""
    query = (
        select(m.Export, m.Checkpoint.stream, m.Checkpoint.step)
        .join(m.Checkpoint, m.Checkpoint.id == m.Export.checkpoint_id)
        .where(m.Export.run_id == run_id)
    )
    if checkpoint_id is not None:
        query = query.where(m.Export.checkpoint_id == checkpoint_id)
    return [
        to_record(row, stream, step)
        for row, stream, step in session.execute(query.order_by(m.Export.id))
    ]


def to_record(row: m.Export, stream: str, step: int) -> Export:
    return Export(
        id=row.id,
        checkpoint_id=row.checkpoint_id,
        stream=stream,
        step=step,
        format=row.format,
        path=Path(row.path),
        size=row.size,
        hash=row.hash,
        tensors=row.tensors,
        files=tuple(ExportedFile(str(n), int(s), str(h)) for n, s, h in json.loads(row.manifest)),
        created_at=row.created_at,
    )
