"""The public, immutable view of one checkpoint row (built by ckptdb.ledger.rows)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path


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
