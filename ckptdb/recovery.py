"""A lost machine's run brought back from its remote tier: the URL alone is enough.

:func:`restore_run` (``ckptdb restore s3://bucket/prefix DIR``) fetches the
newest sound copy of the run's SQLite ledger (see :mod:`ckptdb.ledgercopy`)
into an empty directory, then opens the run there with ``remote=``: the open
brings back the newest whole copy of every stream (whatever the local window
had dropped), and its reconcile marks ``lost`` every committed checkpoint
whose copy never completed. The history up to the ledger's copy (metrics,
events, attempts, evaluations) comes with it. A checkpoint committed after
the ledger's last copy is not restorable by this path (docs/replication.md,
"The recovery point").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .errors import (
    InvalidArgumentError,
    LedgerReplicaNotFoundError,
    RestoreTargetError,
    RunDirectoryError,
    note_on,
)
from .ledger.engine import LEDGER_FILE
from .ledgercopy import STATE_NAME, FetchedLedger, bring_back, choose_run, replicated_runs
from .location import is_object_url, redacted
from .manager import CheckpointManager, refuse_object_root
from .record import Checkpoint
from .storage.files import make_dir, remove
from .storage.remote import remote_store


@dataclass(frozen=True)
class RunRestore:
    """What :func:`restore_run` brought back.

    Attributes:
        root: The run's new root, resolved.
        ledger: The copy of the ledger that was brought back (a
            :class:`~ckptdb.ledgercopy.FetchedLedger`: ``run``, ``location``,
            ``copied_at``, ``epoch``, ``seq``, ``claimed_epoch``, ``damaged``).
        restored: The checkpoints downloaded, verified and committed again.
        lost: The number of committed checkpoints whose copy never completed, now
            marked ``lost``.
    """

    root: Path
    ledger: FetchedLedger
    #: the checkpoints downloaded, verified and committed again
    restored: list[Checkpoint] = field(default_factory=list)
    #: committed checkpoints whose copy never completed, now marked ``lost``
    lost: int = 0


def restore_run(
    source: str,
    root: str | os.PathLike[str],
    *,
    run: str | None = None,
    every: bool = False,
    storage_options: Mapping[str, object] | None = None,
) -> RunRestore:
    """Bring the run replicated to ``source`` back into ``root`` (new or empty).

    For a lost machine's run on the default SQLite ledger (``ckptdb restore URL
    DIR``): the URL alone is enough. The newest sound copy of the ledger is fetched
    into ``root``, then the run is opened there with ``remote=source``: the open
    brings back the newest whole copy of every stream, and its reconcile marks
    ``lost`` every committed checkpoint whose copy never completed. The history up
    to the ledger's copy (metrics, events, attempts, evaluations) comes with it; a
    checkpoint committed after the ledger's last copy is not restorable this way
    (docs/replication.md, "The recovery point"). Then train with
    ``CheckpointManager(root, remote=source)``. A refusal writes nothing; a restore
    that fails while fetching the ledger removes what it wrote.

    Args:
        source: The object-storage URL (``s3://bucket/prefix``) a
            :class:`~ckptdb.replication.Replicator` copied the run to.
        root: The directory the run comes back into, local, new or empty.
        run: The run's name (or its token, to tell runs of one name apart), when
            ``source`` holds the ledgers of several runs; None (the default): the
            only one there.
        every: Every checkpoint with a whole copy, not only each stream's newest
            (default False).
        storage_options: The object store's options (see docs/s3.md); None (the
            default): none.

    Returns:
        What was brought back: the root, the ledger's copy, the checkpoints
            restored and how many were marked lost.

    Raises:
        InvalidArgumentError: ``source`` is not an object-storage URL, ``root`` is
            one, or ``source`` holds the ledgers of several runs and ``run`` does
            not say which (it names them).
        RestoreTargetError: ``root`` is not empty.
        RunDirectoryError: ``root`` is not a directory.
        LedgerReplicaNotFoundError: no copy of a ledger at ``source``, or none of
            ``run`` (the error names the runs there).
        CorruptLedgerReplicaError: every copy of the ledger there is damaged.
        ObjectStoreError: ``source`` could not be read.
    """
    if not isinstance(source, str) or not is_object_url(source):
        shown = repr(redacted(source)) if isinstance(source, str) else type(source).__name__
        raise InvalidArgumentError(f"source must be an object-storage URL, got {shown}")
    refuse_object_root(root, "root")
    target = Path(root).resolve()
    _check_empty(target)
    remote = remote_store(source, storage_options, probe=False)
    token = choose_run(remote, run)
    if token is None:
        raise LedgerReplicaNotFoundError(_nothing_there(source, run, replicated_runs(remote)))
    created = not target.exists()
    make_dir(target)
    try:
        fetched = bring_back(remote, target, target / LEDGER_FILE, token)
    except BaseException as exc:
        _undo(target, created, exc)
        raise
    with CheckpointManager(target, remote=source, remote_options=storage_options) as mgr:
        restored = list(mgr.restored_at_open)
        lost = mgr.last_reconcile.counts.get("lost", 0)
        if every:
            restored += mgr.restore(source, every=True, storage_options=storage_options)
    return RunRestore(target, fetched, restored, lost)


def _check_empty(target: Path) -> None:
    if not target.exists():
        return
    if not target.is_dir():
        raise RunDirectoryError(f"{target} is not a directory: restore into a new or empty one")
    entries = sorted(p.name for p in target.iterdir())
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise RestoreTargetError(
            f"{target} is not empty ({shown}): a restore from a URL writes a whole run and "
            "never over one; restore into a new or empty directory (to bring checkpoints "
            "back into an existing run: ckptdb restore ROOT --from URL)"
        )


def _nothing_there(source: str, run: str | None, runs: dict[str, str]) -> str:
    what = f"of the run {run!r} " if run is not None else ""
    there = f"; the ledgers there are of: {', '.join(sorted(set(runs.values())))}" if runs else ""
    return (
        f"no ledger copy {what}under {redacted(source)}{there}. A ledger is copied by a replicator "
        "(ckptdb replicate, Replicator) of a run on a SQLite ledger; a PostgreSQL run "
        "needs none (ckptdb restore ROOT --from URL --db-url ...)"
    )


def _undo(target: Path, created: bool, failure: BaseException) -> None:
    """What a failed restore wrote, removed: the directory if it made it, else its files
    (a removal that fails is noted on ``failure``, the error the caller gets)."""
    try:
        if created:
            remove(target)  # a directory it made: removed with what is in it
            return
        for name in (LEDGER_FILE, STATE_NAME, f".{STATE_NAME}.restoring"):
            remove(target / name)
    except OSError as cleanup:
        note_on(failure, f"removing what the restore wrote in {target} failed too: {cleanup}")


__all__ = ["RunRestore", "restore_run"]
