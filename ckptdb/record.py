"""The public, immutable view of one checkpoint row (built by ckptdb.ledger.rows),
and of one derived alias (a row of ``aliases``).

Also the record's vocabulary: the states a :attr:`Checkpoint.state` takes (the
``checkpoints.state`` column's values, see docs/ledger.md) and the clock its
timestamps are read against. They are defined here, not in the ledger, so that
code above the ledger (the CLI, integrations) names them without importing
:mod:`ckptdb.ledger`; :mod:`ckptdb.ledger.models` imports them from here.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, fields
from pathlib import Path

# Publication states of a checkpoint row (see docs/ledger.md, "Checkpoint states").
PENDING = "pending"
COMMITTED = "committed"
DELETING = "deleting"
DELETED = "deleted"
ABORTED = "aborted"
LOST = "lost"
CORRUPT = "corrupt"
STATES = (PENDING, COMMITTED, DELETING, DELETED, ABORTED, LOST, CORRUPT)

#: The file name of a run's own SQLite ledger, in its root.
LEDGER_FILE = "ckptdb.sqlite"

#: The ledger's schema revision this ckptdb writes and reads: the newest migration
#: (``ckptdb.ledger.engine.HEAD_REVISION``; a new migration moves it).
LEDGER_REVISION = "0010"

#: How an attempt (one process's life on a run, ``attempts.end_state``) ended:
#: ``running`` until it ends; ``crashed`` is written by the next attempt's start.
END_STATES = ("running", "closed", "failed", "crashed", "preempted")

#: Every ``events.kind`` the code writes. The ledger refuses any other, so this
#: list and docs/ledger.md's (compared by tests/test_docs.py) are complete.
EVENT_KINDS = (
    "attempt_started",
    "resumed",
    "guard_tripped",
    "publish_failed",
    "foreign",
    "cleanup_failed",
    "commit_settled",
    # what reconcile did, one event per action (also a load finding a bad payload)
    "rolled_back",
    "deleted",
    "lost",
    "corrupt",
    "restored",
    "repointed",
    "removed_temp",
    "quarantined",
    "aliased",
    "alias_left",
    "failed",
    "adopted",
    "world_size_changed",
    "preempted",
    "preemption_saved",
    "interval",
    "restored_from_replica",
    "restore_failed",
    "copy_impossible",
    "ledger_restored",
    "save_dir_recreating",
    "save_dir_recreated",
)


def utcnow() -> dt.datetime:
    """Now, timezone-aware UTC: the ledger's clock (timestamps it stores and reads back)."""
    return dt.datetime.now(dt.timezone.utc)


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint as the ledger records it: an immutable record.

    What the manager and the reader hand back (``latest``, ``best``,
    ``checkpoints``, ``save``...). A record is a snapshot of its row when it was
    read: a later eviction or repair does not change it. Two records compare equal
    when their stream, step, path, size, hash, metric, state and commit time are.

    Attributes:
        stream: The stream it belongs to.
        step: The training step it was saved at.
        path: Where it is, absolute (an object-storage path for an ``s3://`` save
            directory): a file, or a directory for a sharded checkpoint or a
            framework's directory.
        size: Its size in bytes (for a directory, the total of its files); None
            before it is measured (a ``pending`` row).
        hash: Its xxh3-128 hash, hex (for a directory, one hash over every file's
            name, size and hash); None before it is measured.
        metric: The value of the ranking metric of its stream's policy (a TopK
            stream's), None for an unranked stream or a save without it.
        state: Its row's state: ``pending``, ``committed``, ``deleting``,
            ``deleted``, ``aborted``, ``lost`` or ``corrupt`` (see
            docs/ledger.md, "Checkpoint states").
        committed_at: When it was committed (timezone-aware UTC); None if it never
            was.
        id: Its row's id in the ledger.
        attempt_id: The id of the attempt that saved it.
        metrics: Every metric saved with it, name -> value (empty: none).
        world_size: The number of ranks that saved it; None when unknown (saved
            before ckptdb recorded it, or adopted).
    """

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


#: The columns of a checkpoint row that make a :class:`Checkpoint`, in its fields'
#: order: what each reader selects (the ledger's fast lookups, the quick read).
CHECKPOINT_FIELDS = tuple(f.name for f in fields(Checkpoint))


@dataclass(frozen=True)
class ExportedFile:
    """One file of an export, as its row's manifest records it.

    Attributes:
        name: The file's name, relative to the export's directory.
        size: Its size in bytes.
        hash: Its xxh3-128 hash, hex, as ``ckptdb check`` verifies it.
    """

    name: str
    size: int
    hash: str


@dataclass(frozen=True)
class Export:
    """A derivative of a committed checkpoint written outside the run (``ckptdb export``).

    The directory ``path`` in ``format`` (Hugging Face safetensors), recorded in the
    ledger's ``exports`` table only once it is complete, so a record always names a
    whole export; ``ckptdb check`` verifies its files against ``files``.

    Attributes:
        id: The export's row id.
        checkpoint_id: The id of the checkpoint it was made from.
        stream: That checkpoint's stream.
        step: That checkpoint's step.
        format: The format written (``"safetensors"``).
        path: The export's directory, absolute (outside the run's save directory).
        size: The total size of its files, in bytes.
        hash: One xxh3-128 hash over every file's name, size and hash, hex.
        tensors: The number of tensors written.
        files: Each file written, with its size and hash.
        created_at: When it was recorded (timezone-aware UTC).
    """

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
    """A name other tools open, derived from the ledger: the latest checkpoint of ``stream``.

    Registered with ``mgr.derive_aliases``; after each change (that call, and every
    reconcile) it names the latest committed checkpoint of ``stream``, so a crash
    between a commit and its aliases does not leave them stale.

    Attributes:
        path: The alias's path, relative to the run root (``model.ckpt.pt``).
        stream: The stream whose latest committed checkpoint it names.
        kind: One of :data:`ALIAS_KINDS`: ``"symlink"`` (a relative symbolic
            link), ``"pointer"`` (a small text file holding the checkpoint's path
            relative to the pointer's directory) or ``"link"`` (a hard link; a
            copy where links are not possible).
    """

    path: str
    stream: str
    kind: str


@dataclass(frozen=True)
class Replica:
    """One copy of a checkpoint on another tier: a row of ``replicas``.

    Made by a :class:`~ckptdb.replication.Replicator`; a copy counts only once its
    state is ``replicated``, which it is only after the bytes sent hash to the
    checkpoint row's size and hash.

    Attributes:
        checkpoint_id: The id of the checkpoint copied.
        stream: That checkpoint's stream.
        step: That checkpoint's step.
        tier: The tier it is on (``"remote"``).
        location: The copy's URL: a prefix holding one object per file of the
            checkpoint.
        state: ``uploading``, ``replicated``, ``failed`` (``error`` says why),
            ``deleting`` or ``deleted`` (removed by the tier's retention).
        size: The size of what was sent, in bytes; None until it is whole.
        hash: The hash of what was sent (as the checkpoint's is taken); None until
            it is whole.
        error: Why the copy failed (or why removing it failed); None otherwise.
        id: The copy's row id.
    """

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
