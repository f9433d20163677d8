"""What one boundary carries between its phases: each stream's share, and the plan
the chief sends to every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..storage.base import FileInfo
from ..storage.kinds import PayloadKind


@dataclass
class Share:
    """One stream's share of a boundary between intent and commit."""

    stream: str
    kind: PayloadKind
    payload: Any
    row_id: int
    final: str  # relative to the save directory
    tmp: str
    metric: float | None
    written: FileInfo | None = None
    info: FileInfo | None = None
    #: The payload was moved onto its final name (a rollback removes that name only then).
    placed: bool = False


@dataclass(frozen=True)
class PlanItem:
    """One admitted stream of a boundary, as the chief recorded it (sent to every rank)."""

    stream: str
    tmp: str  # relative to the save directory
    kind: str
