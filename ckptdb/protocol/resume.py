"""What the writer's open does with ``remote=``: resume from the newest checkpoint the
run can reach, before reconcile judges the save directory.

A stream's newest whole copy is brought back when no newer committed
checkpoint of it is here (see :func:`.restore.restore`, ``at_open``).

The save directory gone (a new machine): the copies are restored first, and
only once every one is back are the missing stream directories made, so that
reconcile marks the checkpoints without a copy lost instead of refusing. If a
copy could not be had, the open is refused (``RunDirectoryError``) with
nothing marked, as without ``remote=``: an empty disk must not be taken for
the truth (training would start over).

Such a restore is remembered until it is finished: a ``save_dir_recreating``
event is committed before its first directory is made, and
``save_dir_recreated`` once every stream directory is. A new machine's restore
cut short (the process killed after one stream's copy was placed, a power cut,
a copy that could not be read) leaves the save directory with some stream
directories and not others; without the event the next open could not tell
that from a filesystem that is not mounted, would refuse, and would go on
refusing. With it, the next open finishes the restore. Any writer open whose
reconcile passes (every stream directory there) ends it too (:func:`settle`).

The save directory here but a stream's directory not, with no restore
unfinished (storage not mounted?): nothing is restored into it, and
reconcile refuses as it always does. Any other failure is said, recorded
(``restore_failed``) and left: a load falls back to the copy then.
"""

from __future__ import annotations

import logging

from ..errors import RunDirectoryError
from ..ledger import boundary_rows
from ..ledger import rows as ledger_rows
from ..record import Checkpoint
from . import restore as restoring
from .absence import absent_directories
from .context import RunContext

log = logging.getLogger(__name__)

#: Events of a new machine's restore: begun (before its first directory), finished.
RECREATING = "save_dir_recreating"
RECREATED = "save_dir_recreated"


def restore_at_open(ctx: RunContext, tier: str) -> list[Checkpoint]:
    """The open's restore from ``ctx.remote`` (see the module docstring); what came back."""
    url = str(ctx.remote.location)
    absent = ctx.store.absent()
    unfinished = not absent and _recreating(ctx)
    if not absent and not unfinished and _unmounted(ctx):
        return []
    begun = unfinished

    def before_first_directory() -> None:
        nonlocal begun
        if absent and not begun:
            ctx.event(RECREATING, detail={"path": str(ctx.save_dir), "remote": url})
            begun = True

    outcome = restoring.restore(
        ctx, ctx.remote, tier, every=False, at_open=True, before=before_first_directory
    )
    for checkpoint, exc in outcome.failures:
        error = f"{type(exc).__name__}: {exc}"
        log.warning("ckptdb: restoring %s from %s failed: %s", checkpoint.path, url, error)
        ctx.event(
            "restore_failed",
            checkpoint_id=checkpoint.id,
            step=checkpoint.step,
            detail={"remote": url, "error": error},
        )
    if not begun:  # no new machine, or nothing to bring back: reconcile judges, as always
        return outcome.restored
    if outcome.failures:
        first = outcome.failures[0][1]
        raise RunDirectoryError(
            f"the save directory {ctx.save_dir} was gone (a new machine?) and restoring "
            f"from {url} failed: {type(first).__name__}: {first}; what was restored is "
            "back, nothing was marked lost: open again once the copies can be read"
        ) from first
    if outcome.skipped:  # an older copy of its stream is there: the next open takes it
        gone = ", ".join(str(c.path) for c in outcome.skipped)
        raise RunDirectoryError(
            f"the save directory {ctx.save_dir} was gone (a new machine?) and the copies "
            f"of {gone} at {url} were removed by the remote tier's retention while they "
            "were restored; nothing was marked lost: open again to restore the newest "
            "copies left"
        )
    log.warning(
        "ckptdb: the save directory %s was gone (a new machine?): the newest copies were "
        "restored from %s; the checkpoints without one will be marked lost",
        ctx.save_dir,
        url,
    )
    for stream in ctx.policies:
        ctx.store.prepare_stream(stream)
    ctx.event(RECREATED, detail={"path": str(ctx.save_dir), "remote": url})
    return outcome.restored


def settle(ctx: RunContext) -> None:
    """After a reconcile that found every stream directory: a new machine's restore left
    unfinished is over (the user made the directories and opened without ``remote=``,
    or restored by hand), so a later disk not mounted is never taken for it."""
    if _recreating(ctx):
        ctx.event(RECREATED, detail={"path": str(ctx.save_dir), "remote": None})


def _recreating(ctx: RunContext) -> bool:
    """Whether a new machine's restore was begun and not finished."""
    with ctx.ledger.transaction(read=True) as session:
        newest = ledger_rows.newest_event_of(session, ctx.run_id, (RECREATING, RECREATED))
    return newest == RECREATING


def _unmounted(ctx: RunContext) -> bool:
    """Whether reconcile would refuse the open for a missing stream directory."""
    with ctx.ledger.transaction(read=True) as session:
        committed = boundary_rows.committed_paths(session, ctx.run_id)
    return absent_directories(ctx.store, committed, "") is not None
