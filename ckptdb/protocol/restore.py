"""Restore: checkpoints brought back from their copies on a remote tier.

For a new machine (the local disk went with the old one) and for a local copy
that no longer matches its row. The writer's work: each checkpoint that has a
``replicated`` copy (see :mod:`ckptdb.replication`) and whose local copy is
missing or does not match its row is downloaded under a temporary name of
ours (each file hashed as it arrives and checked against the copy's manifest,
the whole against the checkpoint row), fsynced, put in place (a bad local
copy moved into the quarantine first, never deleted) and its row committed
again, with ``latest`` re-pointed and a ``restored_from_replica`` event. Until
a whole, verified copy is on disk nothing is replaced; a failure removes the
temporary and leaves the row as it was. A crash in between leaves a
temporary: in ckptdb's own naming the next reconcile removes it; under a
framework's name (``.<name>.ckptdb-tmp-<id>``, which reconcile only removes
for a save's pending row) the next restore of that checkpoint does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    ObjectStoreError,
    PhaseError,
    note_on,
)
from ..ledger import replicas as ledger_replicas
from ..ledger import rows as ledger_rows
from ..ledger.models import COMMITTED, DELETED
from ..record import Checkpoint
from ..storage.base import FileInfo
from ..storage.external import temp_for
from ..storage.naming import is_own_name, temp_name
from .context import RunContext
from .reconcile import QUARANTINE_NAME

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What a restore did: the checkpoints brought back, and those it could not (each
    with its error; the others were restored all the same)."""

    restored: list[Checkpoint] = field(default_factory=list)
    failures: list[tuple[Checkpoint, Exception]] = field(default_factory=list)
    #: whose copy the remote tier's retention removed while it was restored
    skipped: list[Checkpoint] = field(default_factory=list)


@dataclass(frozen=True)
class _Wanted:
    checkpoint: Checkpoint
    replica_id: int
    location: str
    manifest: str | None


def restore(
    ctx: RunContext,
    remote: Any,
    tier: str,
    *,
    every: bool,
    at_open: bool = False,
    before: Callable[[], None] | None = None,
) -> Outcome:
    """Bring back what needs it: the newest checkpoint of each stream that has a whole
    copy under ``remote`` (``every``: each one that has). The newest may be one the
    local window evicted (a replicator that lagged, a machine lost since): it is
    brought back, and committed again, when no newer checkpoint of its stream is
    whole here, so a run resumes from the newest copy there is.

    ``at_open`` (an open with ``remote=``): only a copy that would become its
    stream's latest (no newer committed checkpoint is here), and a committed row's
    local copy is judged by its presence and size alone (the load hashes what it
    loads, and falls back to the copy then); a lost or corrupt row's is always
    hashed. A failure is kept in the outcome and the rest goes on. ``before``: called
    once, before anything is written, when there is something to bring back."""
    with ctx.ledger.transaction() as session:
        found = ledger_replicas.restorable(
            session, ctx.run_id, tier, remote.url_prefix, newest_only=False, evicted=not every
        )
        wanted = [
            _Wanted(ledger_rows.to_record(row, ctx.save_dir), r.id, r.location, r.manifest)
            for row, r in found
            if remote.rel_of(r.location) is not None  # another destination's: not ours
        ]
    if not every:
        wanted = _newest_of_each_stream(ctx, wanted)
    wanted = [
        w
        for w in wanted
        if not (at_open or w.checkpoint.state == DELETED) or _would_be_latest(ctx, w.checkpoint)
    ]
    if wanted and before is not None:
        before()
    outcome = Outcome()
    for w in wanted:
        try:
            full = not at_open or w.checkpoint.state != COMMITTED
            done = _restore(ctx, remote, w, full=full, skipped=outcome.skipped)
        except (ObjectStoreError, CorruptCheckpointError, InvalidArgumentError, OSError) as exc:
            outcome.failures.append((w.checkpoint, exc))  # PhaseError is an OSError
            continue
        if done is not None:
            outcome.restored.append(done)
    return outcome


def restore_one(ctx: RunContext, remote: Any, tier: str, checkpoint: Checkpoint) -> bool:
    """Bring ``checkpoint`` back from its whole copy under ``remote``, if it has one (a
    load that found its local copy missing or corrupt); whether it did."""
    with ctx.ledger.transaction() as session:
        replica = ledger_replicas.replicated(session, checkpoint.id, tier, remote.url_prefix)
        found = None
        if replica is not None and remote.rel_of(replica.location) is not None:
            found = _Wanted(checkpoint, replica.id, replica.location, replica.manifest)
    if found is None:
        return False
    rel = ctx.rel(checkpoint.path)
    _checked_bring_back(ctx, remote, found, rel)
    _recommit(ctx, checkpoint, found.location)
    return True


def _newest_of_each_stream(ctx: RunContext, wanted: list[_Wanted]) -> list[_Wanted]:
    """The first of each stream (:func:`ledger_replicas.restorable` orders each stream's
    checkpoints newest first) that is not an evicted one of an abandoned timeline."""
    seen: set[str] = set()
    chosen = []
    for w in wanted:
        if w.checkpoint.stream in seen:
            continue
        if w.checkpoint.state == DELETED and not _still_its_timeline(ctx, w):
            continue
        seen.add(w.checkpoint.stream)
        chosen.append(w)
    return chosen


def _still_its_timeline(ctx: RunContext, w: _Wanted) -> bool:
    """Whether an evicted checkpoint was dropped by the window alone, not left behind by
    a resume from an earlier step (then it belongs to an abandoned timeline)."""
    c = w.checkpoint
    with ctx.ledger.transaction(read=True) as session:
        return not ledger_rows.left_behind(session, ctx.run_id, c.stream, c.id, c.step)


def _would_be_latest(ctx: RunContext, checkpoint: Checkpoint) -> bool:
    """Whether no newer committed checkpoint of its stream is here (present, its size
    right): else restoring it would revive what the stream has moved past (an
    abandoned timeline, an older step), and latest is the newer one anyway."""
    with ctx.ledger.transaction(read=True) as session:
        newer = ledger_rows.committed_after(session, ctx.run_id, checkpoint.stream, checkpoint.id)
        records = [ledger_rows.to_record(row, ctx.save_dir) for row in newer]
    return not any(_whole_here(ctx, r, ctx.rel(r.path), full=False) for r in records)


def _restore(
    ctx: RunContext, remote: Any, w: _Wanted, *, full: bool, skipped: list[Checkpoint]
) -> Checkpoint | None:
    """One checkpoint: its local copy kept if whole (its row committed again if it was
    marked bad), else its copy brought back; None when nothing was needed, or when
    the tier's retention removed the copy meanwhile (then added to ``skipped``)."""
    checkpoint = w.checkpoint
    rel = ctx.rel(checkpoint.path)
    if _whole_here(ctx, checkpoint, rel, full):  # e.g. a crash after the place
        return _recommit(ctx, checkpoint, w.location) if checkpoint.state != COMMITTED else None
    try:
        _checked_bring_back(ctx, remote, w, rel)
    except ObjectStoreError:
        if _still_whole(ctx, w.replica_id):
            raise
        log.warning(  # nothing was replaced; the rest are restored all the same
            "ckptdb: the copy of %s at %s was removed by the remote tier's retention "
            "while it was restored; skipped",
            checkpoint.path,
            w.location,
        )
        skipped.append(checkpoint)
        return None
    return _recommit(ctx, checkpoint, w.location)


def _checked_bring_back(ctx: RunContext, remote: Any, w: _Wanted, rel: str) -> None:
    """:func:`_bring_back`; a copy that does not match its manifest or row is marked
    ``failed`` (never offered again: the replicator copies the checkpoint anew while
    its local copy is whole) before the error propagates."""
    try:
        _bring_back(ctx, remote, w.checkpoint, rel, w.location, w.manifest)
    except CorruptCheckpointError as exc:
        with ctx.ledger.transaction() as session:
            ledger_replicas.mark_bad_copy(session, w.replica_id, f"{type(exc).__name__}: {exc}")
        raise


def _still_whole(ctx: RunContext, replica_id: int) -> bool:
    """Whether the copy is still ``replicated`` (not dropped by the remote window since)."""
    with ctx.ledger.transaction(read=True) as session:
        return ledger_replicas.state_of(session, replica_id) == ledger_replicas.REPLICATED


def _whole_here(ctx: RunContext, checkpoint: Checkpoint, rel: str, full: bool) -> bool:
    return ctx.store.verify(rel, checkpoint.size, checkpoint.hash, full=full) is None


def _files(manifest: str | None) -> tuple[bool, list[tuple[str, FileInfo]]]:
    """(whether the copy is of a directory, each file's name, size and hash)."""
    found = json.loads(manifest) if manifest else {}
    files = [(str(n), FileInfo(int(s), str(h))) for n, s, h in found.get("files", [])]
    return found.get("kind") == "directory", files


def _bring_back(
    ctx: RunContext,
    remote: Any,
    checkpoint: Checkpoint,
    rel: str,
    location: str,
    manifest: str | None,
) -> None:
    """Download the copy at ``location`` next to ``rel``, verify it, then put it in place."""
    source = remote.rel_of(location)
    if source is None:
        raise InvalidArgumentError(
            f"the copy of {checkpoint.path} is at {location}, outside {remote.location}"
        )
    directory, files = _files(manifest)
    store = ctx.store
    tmp = _prepared_temp(store, checkpoint, rel)
    store.remove(tmp)  # a crashed restore's leftover
    if directory:
        store.make_temp_dir(tmp)
    try:
        got = _download(store, remote, tmp, source, files, directory)
        whole = store.seal(tmp) if directory else got[0][1]
        if (whole.size, whole.hash) != (checkpoint.size, checkpoint.hash):
            raise CorruptCheckpointError(
                f"the copy at {remote.url_of(source)} does not match the row of {checkpoint.path}"
            )
        if store.exists(rel):  # a bad local copy: kept aside, never deleted
            store.quarantine(rel, ctx.root / QUARANTINE_NAME / checkpoint.stream)
        store.place(tmp, rel)
        store.sync_placed([rel])
    except BaseException as exc:
        _remove_temp(store, tmp, exc)
        raise


def _prepared_temp(store: Any, checkpoint: Checkpoint, rel: str) -> str:
    """The temporary name next to ``rel`` (the one a save of it would use, so that
    reconcile knows it), its directory made first (durably, parents included: a new
    machine's disk is empty)."""
    if is_own_name(rel):
        store.prepare_stream(checkpoint.stream)
        return str(Path(rel).parent / temp_name(checkpoint.path.name, checkpoint.id))
    store.prepare_parent(rel)  # a framework's name: the save directory itself, maybe
    return temp_for(rel, checkpoint.id)


def _download(
    store: Any,
    remote: Any,
    tmp: str,
    source: str,
    files: list[tuple[str, FileInfo]],
    directory: bool,
) -> list[tuple[str, FileInfo]]:
    """Each file of the copy into ``tmp`` (a file, or files inside a directory), checked
    against the manifest as it arrives."""
    got = []
    for name, expected in files:
        target = f"{tmp}/{name}" if directory else tmp
        if directory and "/" in name:
            for parent in reversed(Path(name).parents[:-1]):
                store.make_temp_dir(f"{tmp}/{parent.as_posix()}")
        try:
            info = store.write_object(target, _copier(remote, f"{source}/{name}"))
        except PhaseError as exc:
            cause = exc.__cause__
            if isinstance(cause, ObjectStoreError):  # the store's read failed, not the disk
                exc.__cause__ = None  # the store's error is the one raised: no loop
                raise cause from cause.__cause__
            raise
        if info != expected:
            raise CorruptCheckpointError(
                f"{remote.url_of(f'{source}/{name}')} is not the file its copy recorded"
            )
        got.append((name, info))
    return got


def _copier(remote: Any, rel: str) -> Callable[[Any], object]:
    def copy(writer: Any) -> None:
        remote.download(rel, writer.write)

    return copy


def _remove_temp(store: Any, tmp: str, failure: BaseException) -> None:
    try:
        store.remove(tmp)
    except Exception as cleanup:  # the restore's own failure stays the one raised
        note_on(failure, f"removing the temporary {tmp} failed too: {cleanup}")


def _recommit(ctx: RunContext, checkpoint: Checkpoint, location: str) -> Checkpoint:
    """The row committed again (it may have been marked lost or corrupt meanwhile)."""
    ctx.change_state(
        checkpoint,
        COMMITTED,
        event="restored_from_replica",
        detail={"path": ctx.rel(checkpoint.path), "from": location},
        error=None,
    )
    log.info("restored %s from %s", checkpoint.path, location)
    return dataclasses.replace(checkpoint, state=COMMITTED)
