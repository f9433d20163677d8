"""Removing what a boundary should not keep: its own leftovers after a failure
(rollback), and what retention evicted after a commit (clean-up).

Both remove payloads through the store first and record the outcome in the
ledger afterwards; what cannot be removed or recorded is reported (path and
error, never swallowed) and left for the next reconcile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import faults
from ..errors import (
    CkptDBError,
    CleanupFailure,
    DatabaseError,
    InvalidArgumentError,
    LedgerError,
    LedgerUnavailableError,
    PhaseError,
    PhaseFailure,
    PublishError,
    WriterLockLostError,
    warn_cleanup,
)
from ..ledger import boundary_rows
from ..ledger import models as m
from ..ledger import rows as ledger_rows
from ..ledger.engine import is_unreachable, one_line, unreachable
from .context import RunContext
from .share import Share


def roll_back(ctx: RunContext, step: int, shares: list[Share], exc: BaseException) -> None:
    """Undo a boundary that failed before its commit; raises PublishError for an
    ordinary error (an interrupt propagates as itself, after the rollback)."""
    failures: list[CleanupFailure] = []
    left: set[int] = set()
    store = ctx.store
    for s in shares:
        # the final name is removed only if this boundary placed it: before that,
        # whatever is there (a framework-named file) is not ours
        for leftover in (s.tmp, s.final) if s.placed else (s.tmp,):
            try:
                store.remove(leftover)
            except (OSError, InvalidArgumentError) as cleanup_exc:
                failures.append(CleanupFailure(store.location / leftover, cleanup_exc))
                left.add(s.row_id)
    phase, path, cause = describe(exc)
    where = f" at {path}" if path is not None else ""
    if isinstance(cause, CkptDBError) and cause.ranks:
        what = str(cause)  # another rank's failure, already described
    else:
        what = f"{type(cause).__name__}: {one_line(cause)}"
    error_text = f"{phase} failed{where}: {what}"
    record_rollback(ctx, step, shares, left, error_text, failures, phase)
    for failure in failures:
        warn_cleanup(f"ckptdb could not {failure}")
    if not isinstance(exc, Exception):
        return  # KeyboardInterrupt & co. propagate unchanged after the cleanup
    path_of = {str(store.location / r): s.stream for s in shares for r in (s.tmp, s.final)}
    unavailable = is_unreachable(cause) and not isinstance(cause, WriterLockLostError)
    kind = LedgerUnavailableError if unavailable else PublishError
    if unavailable:
        error_text = f"{phase} failed: {unreachable(ctx.ledger.safe_url, cause)}"
    raise kind(
        f"step {step} not published: {error_text}",
        phase=phase,
        step=step,
        path=path,
        stream=path_of.get(str(path)),
        cleanup_failures=failures,
    ) from cause


def record_rollback(
    ctx: RunContext,
    step: int,
    shares: list[Share],
    left: set[int],
    error: str,
    failures: list[CleanupFailure],
    phase: str,
) -> None:
    """Mark rows aborted (or leave them pending for reconcile if files remain).

    Not by a writer another one fenced off: the run is the other's now, and its
    open's reconcile has dealt (or will deal) with this writer's pending rows."""
    if ctx.lock is not None and ctx.lock.lost is not None:
        failures.append(
            CleanupFailure(
                Path(ctx.ledger.database),
                WriterLockLostError(ctx.lock.lost),
                action="record the rollback (left to the run's current writer) in",
            )
        )
        return
    try:
        with ctx.ledger.transaction() as session:
            aborted = [s.row_id for s in shares if s.row_id not in left]
            ledger_rows.set_state(session, aborted, m.ABORTED, error=error)
            for row_id in left:
                ledger_rows.set_state(session, [row_id], m.PENDING, error=error)
            ledger_rows.add_event(
                session,
                ctx.run_id,
                ctx.attempt_id,
                "publish_failed",
                step=step,
                detail={"phase": phase, "error": error},
            )
            for failure in failures:
                ledger_rows.add_event(
                    session,
                    ctx.run_id,
                    ctx.attempt_id,
                    "cleanup_failed",
                    step=step,
                    detail={"path": str(failure.path), "error": repr(failure.error)},
                )
            for s in shares:  # a name someone else took first: theirs, for every reconcile
                if ctx.store.disowned(s.final):
                    ledger_rows.add_event(
                        session,
                        ctx.run_id,
                        ctx.attempt_id,
                        ledger_rows.FOREIGN,
                        checkpoint_id=s.row_id,
                        step=step,
                        detail={"path": s.final, "detail": "taken by another writer; left alone"},
                    )
    except DatabaseError as db_exc:
        # Rows stay pending; the next reconcile rolls them back.
        failures.append(
            CleanupFailure(
                Path(ctx.ledger.database),
                db_exc,  # one line; the driver's own error is its __cause__
                action="record the rollback (rows stay pending for reconcile) in",
            )
        )


def clean_up(ctx: RunContext, step: int | None, evicted: list[Any]) -> None:
    """Remove evicted payloads and mark them deleted; failures are left for reconcile."""
    if not evicted:
        return
    removed: list[int] = []
    failures: list[tuple[Any, Path, BaseException]] = []
    for row in evicted:
        try:
            ctx.store.remove(row.path)
            removed.append(row.id)
            faults.point("mid_cleanup")
        except (OSError, InvalidArgumentError) as err:
            failures.append((row, ctx.save_dir / row.path, err))
    try:
        with ctx.ledger.transaction(durable=False) as session:
            boundary_rows.mark_deleted(session, removed)
            for row, path, error in failures:
                ledger_rows.add_event(
                    session,
                    ctx.run_id,
                    ctx.attempt_id,
                    "cleanup_failed",
                    checkpoint_id=row.id,
                    step=step,
                    detail={"path": str(path), "error": repr(error)},
                )
    except DatabaseError as db_exc:
        warn_cleanup(
            f"ckptdb could not record the cleanup of step {step}: {db_exc}; "
            "the next reconcile finishes it",
        )
    for _row, path, error in failures:
        warn_cleanup(
            f"ckptdb could not remove evicted checkpoint {path}: {error}; it stays "
            "'deleting' and the next reconcile retries",
        )


def describe(exc: BaseException) -> tuple[str, Path | None, BaseException]:
    """(phase, path, underlying error) of a failure inside a boundary."""
    if isinstance(exc, PhaseFailure):
        return exc.phase, None, exc.error
    if isinstance(exc, PhaseError):
        return exc.phase, exc.path, exc.error
    if isinstance(exc, PublishError) and exc.ranks:  # agreed by the ranks: its phase is known
        return exc.phase, exc.path, exc
    if isinstance(exc, DatabaseError):
        return "commit", None, exc.original or exc
    if isinstance(exc, LedgerError):
        return "commit", None, exc
    return "write", None, exc
