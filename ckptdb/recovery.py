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
    """What :func:`restore_run` brought back."""

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

    ``run``: the run's name, when ``source`` holds the ledgers of several.
    ``every``: every checkpoint with a whole copy, not only each stream's
    newest. Refused, with nothing written: ``source`` not an object-storage
    URL, ``root`` not empty (:class:`RestoreTargetError`), no ledger copy there
    (:class:`LedgerReplicaNotFoundError`), every copy damaged
    (:class:`CorruptLedgerReplicaError`). Then train with
    ``CheckpointManager(root, remote=source)``.
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
