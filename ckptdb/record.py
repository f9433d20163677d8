"""The public, immutable view of one checkpoint row (built by ckptdb.ledger.rows),
and of one derived alias (a row of ``aliases``).

Also the record's vocabulary: the states a :attr:`Checkpoint.state` takes (the
``checkpoints.state`` column's values, see docs/guarantees.md) and the clock its
timestamps are read against. They are defined here, not in the ledger, so that
code above the ledger (the CLI, integrations) names them without importing
:mod:`ckptdb.ledger`; :mod:`ckptdb.ledger.models` imports them from here.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

# Publication states of a checkpoint row (see docs/guarantees.md).
PENDING = "pending"
COMMITTED = "committed"
DELETING = "deleting"
DELETED = "deleted"
ABORTED = "aborted"
LOST = "lost"
CORRUPT = "corrupt"
STATES = (PENDING, COMMITTED, DELETING, DELETED, ABORTED, LOST, CORRUPT)


def utcnow() -> dt.datetime:
    """Now, timezone-aware UTC: the ledger's clock (timestamps it stores and reads back)."""
    return dt.datetime.now(dt.timezone.utc)


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
    #: The number of ranks that saved it (None: unknown, saved before ckptdb recorded it).
    world_size: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ExportedFile:
    """One file of an export, as its row's manifest records it."""

    name: str
    size: int
    hash: str


@dataclass(frozen=True)
class Export:
    """A derivative of a committed checkpoint written outside the run (``ckptdb
    export``): the directory ``path`` in ``format``, complete when recorded."""

    id: int
    checkpoint_id: int
    stream: str
    step: int
    format: str
    path: Path
    size: int
    hash: str
    tensors: int
    files: tuple[ExportedFile, ...]
    created_at: dt.datetime


# Kinds of a derived alias (the ``aliases.kind`` column's values, see docs/ledger.md).
SYMLINK = "symlink"  # a relative symbolic link (DeePMD's model.ckpt.pt)
POINTER = "pointer"  # a small text file naming the checkpoint (DeePMD's checkpoint)
LINK = "link"  # a hard link (a copy where links are not possible), Lightning's last.ckpt
ALIAS_KINDS = (SYMLINK, POINTER, LINK)


@dataclass(frozen=True)
class DerivedAlias:
    """A name other tools open, derived from the ledger: after each change it names
    the latest committed checkpoint of ``stream``. ``path`` is relative to the run
    root (``model.ckpt.pt``); ``kind`` one of :data:`ALIAS_KINDS`. A pointer's text is
    the checkpoint's path relative to the pointer's directory."""

    path: str
    stream: str
    kind: str


@dataclass(frozen=True)
class Replica:
    """One copy of a checkpoint on another tier (a row of ``replicas``, see
    ckptdb.replication): ``location`` is the copy's URL (a prefix holding one object
    per file of the checkpoint), ``state`` ``uploading``, ``replicated`` or
    ``failed`` (``error`` says why)."""

    checkpoint_id: int
    stream: str
    step: int
    tier: str
    location: str
    state: str
    size: int | None
    hash: str | None
    error: str | None
    id: int = field(compare=False)
