"""The public, immutable view of one checkpoint row."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path

from . import models as m


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint as the ledger records it. ``path`` is absolute."""

    stream: str
    step: int
    path: Path
    size: int | None
    hash: str | None
    metric: float | None
    state: str
    committed_at: dt.datetime | None
    id: int = field(compare=False)
    attempt_id: int = field(compare=False)
    metrics: dict[str, float] = field(default_factory=dict, compare=False)

    @classmethod
    def from_row(cls, row: m.Checkpoint, save_dir: Path) -> Checkpoint:
        return cls(
            stream=row.stream,
            step=row.step,
            path=save_dir / row.path,
            size=row.size,
            hash=row.hash,
            metric=row.metric,
            state=row.state,
            committed_at=row.committed_at,
            id=row.id,
            attempt_id=row.attempt_id,
            metrics=json.loads(row.metrics) if row.metrics else {},
        )
