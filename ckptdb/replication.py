"""Replication: a second copy of every committed checkpoint, on object storage.

A run saves on its fast local tier exactly as it always does; a
:class:`Replicator` (in the trainer's process, on a thread, or as
``ckptdb replicate ROOT --to s3://...`` beside it) copies each committed
checkpoint to a remote tier, and the ledger's ``replicas`` table says, per
copy, ``uploading``, ``replicated`` or ``failed``. The training loop never waits
for an upload.

A copy has the guarantees of a direct save to object storage: every object
goes under a key no other copy uses (``<stream>/step-<step>.<run token>.r<replica
id>/<file>``), is completed with ``If-None-Match: *`` and HEAD-checked, and
the copy counts only once its replica row says ``replicated``, which it does
only after the bytes sent hash to the checkpoint row's size and hash (a local
copy that no longer matches its row is never replicated). The file being
copied is pinned, so local retention cannot remove it mid-upload. A
replicator that dies mid-copy leaves its row ``uploading``; the next one (one
per run at a time: a lock file in the run's root) aborts the upload, removes
its objects and marks the row ``failed``, then copies the checkpoint again
under a new key. So a copy is resumed by redoing it, never duplicated, and
never recorded as replicated unless it is.

A run on a SQLite ledger has its ledger copied too, beside the copies
(:mod:`ckptdb.ledgercopy`): after every pass that copied or removed a
checkpoint, and otherwise at most every ``ledger_interval`` seconds while it
changes. So a lost machine comes back from the URL alone (``ckptdb restore
URL DIR``, or an open with ``remote=`` on a directory without a ledger).

Restoring (a new machine, a corrupt local copy) is the writer's:
:meth:`ckptdb.CheckpointManager.restore`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from filelock import FileLock, Timeout

from .errors import (
    ArgumentTypeError,
    CkptDBError,
    CorruptCheckpointError,
    InvalidArgumentError,
    LedgerLockedError,
    PhaseError,
    UnknownStreamError,
    note_on,
)
from .ledger import Ledger, open_ledger
from .ledger import models as m
from .ledger import replicas as ledger_replicas
from .ledger import rows as ledger_rows
from .ledger import tiers as ledger_tiers
from .ledger.engine import backend_name
from .ledger.lock import AdvisoryWriterLock, replicator_lock
from .ledger.netfs import check_ledger_location, sqlite_path
from .ledger.rows import to_record
from .ledger.runs import ledger_url
from .ledgercopy import DEFAULT_INTERVAL, LedgerCopier, LedgerCopy
from .location import ObjectPath, is_object_url
from .policies import POLICY_KINDS, Entry, Policy, replayed_evictions
from .reader import RunReader
from .record import Checkpoint, Replica
from .storage.files import FileInfo, combine, tree_files
from .storage.naming import run_token
from .storage.remote import REMOTE, remote_store

log = logging.getLogger(__name__)

#: Copies of one checkpoint that may fail before the replicator stops trying.
MAX_FAILURES = 3
#: Seconds after a copy failed during which objects of it may still land (a PUT the
#: server completes after the client gave up): its prefix is swept until then ...
LATE_LANDING_S = 600.0
#: ... at most this often (and once more at the next replicator's start).
SWEEP_EVERY_S = 60.0
#: What a failed sweep adds to its copy's error (replaced, never repeated, by the next one).
SWEEP_FAILED = "; sweeping it failed: "
#: The lock file (in the run's root) that keeps a run to one replicator at a time.
LOCK_NAME = ".ckptdb.replicator.lock"
#: Bytes read from a local file per write into the upload.
CHUNK = 8 << 20


class Replicator:
    """Copies each committed checkpoint of the run at ``root`` to ``to`` (``s3://...``).

    The run saves on its fast local tier as always; the replicator (in the
    trainer's process, on a thread with :meth:`start`, or as ``ckptdb replicate``
    beside it) copies each committed checkpoint to object storage, and the training
    loop never waits for an upload. A copy counts only once its bytes hash to the
    checkpoint row's size and hash; the file being copied is pinned, so local
    retention cannot remove it mid-upload. One replicator per run at a time: a lock
    file in the root, and on a PostgreSQL ledger also an advisory lock, so across
    machines.

    Opening cleans up after a replicator that died mid-copy (:attr:`swept`) and
    registers the tier: from then on local retention keeps an evicted checkpoint of
    a copied stream until its copy is whole. A SQLite ledger is copied too
    (:mod:`ckptdb.ledgercopy`), so a lost machine comes back from the URL alone.
    It is a context manager: leaving the ``with`` block closes it. See
    docs/replication.md.

    Args:
        root: The run's root directory (the run must exist; its checkpoints must be
            on a local disk).
        to: Where the copies go, an object-storage URL (``s3://bucket/prefix``).
        db_url: The run's ledger URL when it is not the SQLite file in ``root``
            (as for the manager); None (the default): that file.
        storage_options: The object store's options, as for a save directory on
            object storage (see docs/s3.md); None (the default): none.
        streams: Copy only these streams; None (the default): every stream. A
            stream left out is local-only: its evictions remove files at once.
        keep: Stream -> :class:`~ckptdb.Keep` or :class:`~ckptdb.TopK`, the remote
            window of a copied stream, applied after each pass to its copies under
            ``to`` (replayed in commit order, the timeline rule included). None
            (the default), or a stream not named: every copy is kept.
        ledger_interval: With a SQLite ledger, the most often (in seconds) the
            ledger is copied while only metrics change (default 60); a pass that
            copied or removed a checkpoint copies it at once, and so does close.

    Attributes:
        root: The run's root, resolved.
        location: The URL copies go to.
        streams: The streams copied, sorted, or None for all.
        keep: The remote window of each stream named in ``keep``.
        swept: The copies a dead replicator left ``uploading``, cleaned up at open
            (their objects removed, their rows ``failed``).
        leftovers: The failed copies whose late objects the last sweep removed.
        expired: The copies the last pass removed (``keep``).
        error: What stopped the background thread of :meth:`start` (None: nothing).
        ledger_copy: The last copy of the ledger (a
            :class:`~ckptdb.ledgercopy.LedgerCopy` with ``epoch``, ``seq``,
            ``location``, ``size``, ``hash``, ``copied_at``), or None.
        ledger_error: Why the last try to copy the ledger failed (None: it did
            not); the next pass retries.

    Raises:
        InvalidArgumentError: ``to`` is not an object-storage URL; the run's
            checkpoints are on object storage already; ``keep`` names a stream
            this replicator does not copy; ``ledger_interval`` is not a positive
            finite number.
        ArgumentTypeError: ``keep`` is not a mapping, or one of its policies is
            not a Keep or a TopK.
        UnknownStreamError: ``keep`` names a stream the run does not have.
        LedgerLockedError: another replicator of the run holds its lock.
        RunTakenOverError: the run was restored on another machine since (a SQLite
            ledger): this replicator stops before it copies or removes anything.
        NetworkFilesystemError: a SQLite ledger on a network filesystem.
        ObjectStoreError: the store at ``to`` fails its probe
            (:class:`~ckptdb.errors.ConditionalWritesUnsupportedError` when it
            ignores ``If-None-Match: *``).
        LedgerError: there is no run at ``root``, or its ledger cannot be used.
        SchemaVersionError: the ledger's schema is not this ckptdb's.
        MissingExtraError: object storage without its optional dependency
            (``pip install 'ckptdb[s3]'``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        to: str,
        *,
        db_url: str | None = None,
        storage_options: Mapping[str, object] | None = None,
        streams: Iterable[str] | None = None,
        keep: Mapping[str, Policy] | None = None,
        ledger_interval: float = DEFAULT_INTERVAL,
    ) -> None:
        _check_poll(ledger_interval, "ledger_interval")
        if not isinstance(to, str) or not is_object_url(to):
            raise InvalidArgumentError("to must be an object-storage URL (s3://bucket/prefix)")
        self._reader = RunReader(root, db_url=db_url, storage_options=storage_options)
        self.root = self._reader.root
        if isinstance(self._reader.save_dir, ObjectPath):
            self._reader.close()
            raise InvalidArgumentError(
                f"the checkpoints of {self.root} are on object storage already "
                f"({self._reader.save_dir}); a replicator copies a run saved on a local disk"
            )
        self.streams = None if streams is None else sorted(set(streams))
        try:
            self.keep = _remote_policies(keep, self.streams, self._reader.policies)
        except BaseException:
            self._reader.close()
            raise
        self._lock = FileLock(str(self.root / LOCK_NAME), timeout=0)
        self._ledger: Ledger | None = None
        self._pg_lock: AdvisoryWriterLock | None = None  # across machines (PostgreSQL)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._external: threading.Event | None = None  # follow()'s own stop
        self.error: BaseException | None = None  # what stopped the background thread
        self.expired: list[Replica] = []  # the copies the last pass removed (keep=)
        self._unranked_said: set[str] = set()  # streams whose unranked copies were logged
        self._ledger_copier: LedgerCopier | None = None  # a SQLite ledger's replica
        #: The last copy of the ledger, and what made the last try fail (a later pass retries).
        self.ledger_copy: LedgerCopy | None = None
        self.ledger_error: Exception | None = None
        try:
            self._lock.acquire()
        except Timeout:
            self._reader.close()
            raise LedgerLockedError(
                f"another replicator holds {self.root / LOCK_NAME}: one per run at a time"
            ) from None
        try:
            self._remote = remote_store(to, storage_options)
            self.location = str(self._remote.location)
            url = ledger_url(self.root, db_url, readonly=False)
            check_ledger_location(url)
            self._ledger = open_ledger(url)
            self._pg_lock = _machines_lock(self.root, url)
            created = self._reader.run_created_at
            assert created is not None
            self._token = run_token(self._reader.run_name, self._reader.run_id, created)
            self._ledger_copier = _ledger_copier(
                self._remote, self.root, url, self._token, self._reader.run_name, ledger_interval
            )
            self._still_ours(look=False)  # a zombie on the old machine copies, removes nothing
            self.swept = self._sweep_interrupted()
            #: The failed copies whose late objects the last sweep removed.
            self.leftovers: list[Replica] = self._sweep_failed(at_start=True)
            self._register()
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------ passes

    def replicate(self, *, retry_failed: bool = False) -> list[Replica]:
        """One pass: copy what has no whole copy yet, then apply the remote window.

        Every committed checkpoint without a whole copy under ``to`` (and every
        evicted one whose local file waits for its copy) is copied, oldest first;
        then the copies the tier's retention (``keep``) no longer keeps are removed
        (:attr:`expired`), and a SQLite ledger is copied if it changed. A copy that
        fails is recorded as ``failed`` on its row (with the error), logged, and not
        raised; a later pass retries it, at most :data:`MAX_FAILURES` times in all.

        Args:
            retry_failed: Also try the checkpoints whose copies failed
                :data:`MAX_FAILURES` times, once more (default False).

        Returns:
            The outcome of each copy this pass made, as a :class:`~ckptdb.Replica`
                (``replicated`` or ``failed``).

        Raises:
            RunTakenOverError: the run was restored on another machine: this
                replicator stops before it copies or removes anything.
            CkptDBError: the replicator is closed.
        """
        limit = None if retry_failed else MAX_FAILURES
        self.expired = []
        self._still_ours(look=False)
        with self._writable().transaction() as session:
            todo = ledger_replicas.to_copy(
                session,
                self._reader.run_id,
                REMOTE,
                self.streams,
                limit,
                ledger_tiers.holder(REMOTE),
                self._remote.url_prefix,
            )
            checkpoints = [to_record(row, self._reader.save_dir) for row in todo]
        if checkpoints:
            self._still_ours()  # a zombie's copies would collide with the new machine's
        done = []
        for checkpoint in checkpoints:
            if self._stopping():
                break
            copied = self._copy(checkpoint)
            if copied is not None:
                done.append(copied)
        if not self._stopping():
            self.expired = self._expire()
            self.leftovers = self._sweep_failed(at_start=False)
        self._copy_ledger(force=bool(done or self.expired))  # the first copy is never delayed
        self._still_ours(look=False)  # as the ledger copy's listing saw it
        return done

    def _still_ours(self, *, look: bool = True) -> None:
        """:class:`RunTakenOverError` if the run (a SQLite ledger's) was restored on another
        machine (``look``: asking the bucket now, else as last seen); a PostgreSQL run has
        one ledger for every machine: nothing to check."""
        if self._ledger_copier is not None:
            self._ledger_copier.check_still_ours(look=look)

    def _copy_ledger(self, *, force: bool) -> None:
        """Copy the ledger if it changed (``force``: now, else when its interval is up);
        a failure is logged and kept in :attr:`ledger_error`, and the next pass retries:
        the checkpoints' copies go on all the same."""
        if self._ledger_copier is None:
            return
        try:
            made = self._ledger_copier.copy(force=force)
        except Exception as exc:
            self.ledger_error = exc
            log.warning("copying the ledger of %s to %s failed: %s", self.root, self.location, exc)
            return
        self.ledger_error = None
        if made is not None:
            self.ledger_copy = made

    def follow(self, *, poll: float = 1.0, stop: threading.Event | None = None) -> None:
        """Pass after pass, ``poll`` seconds apart, until stopped.

        Stops after the copy in progress once ``stop`` is set, or :meth:`stop` or
        :meth:`close` is called. An error a pass raises ends it.

        Args:
            poll: Seconds between two passes (default 1.0), a positive finite number.
            stop: An event that stops it when set; None (the default): only
                :meth:`stop` or :meth:`close` do.

        Raises:
            InvalidArgumentError: ``poll`` is not a positive finite number.
            RunTakenOverError: the run was restored on another machine.
        """
        _check_poll(poll)
        self._external = stop
        try:
            while not self._stopping():
                self.replicate()
                (stop or self._stop).wait(poll)
        finally:
            self._external = None

    def stop(self) -> None:
        """Stop following after the copy in progress (from a signal handler too)."""
        self._stop.set()

    def _stopping(self) -> bool:
        return self._stop.is_set() or (self._external is not None and self._external.is_set())

    def start(self, *, poll: float = 1.0) -> Replicator:
        """Follow on a background thread, in the trainer's process.

        :meth:`close` stops it after the copy in progress. A pass that raises stops
        the thread; its error is logged and kept in :attr:`error`, and :meth:`close`
        raises it.

        Args:
            poll: Seconds between two passes (default 1.0), a positive finite number.

        Returns:
            The replicator itself, so that ``Replicator(...).start()`` can be kept.

        Raises:
            InvalidArgumentError: ``poll`` is not a positive finite number.
        """
        _check_poll(poll)

        def run() -> None:
            try:
                self.follow(poll=poll)
            except BaseException as exc:  # kept for close(): a thread's error has no caller
                self.error = exc
                log.error("ckptdb replicator of %s stopped: %s", self.root, exc)

        self._thread = threading.Thread(target=run, name="ckptdb-replicator", daemon=True)
        self._thread.start()
        return self

    def replicas(self) -> list[Replica]:
        """Every copy of the run's checkpoints, oldest first.

        Returns:
            A record per copy, a :class:`~ckptdb.Replica`, in any state and under
                any destination.

        Raises:
            CkptDBError: the replicator is closed.
        """
        with self._writable().transaction() as session:
            found = ledger_replicas.of_run(session, self._reader.run_id)
            return [ledger_replicas.to_record(session, row) for row in found]

    # ------------------------------------------------------------------ one copy

    def _copy(self, checkpoint: Checkpoint) -> Replica | None:
        """Copy one checkpoint (None: evicted before it could be pinned)."""
        pin: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if checkpoint.state == m.COMMITTED:  # an evicted one is held for this copy already
            try:
                pin = self._reader.pin(checkpoint, holder="replicator")
            except CkptDBError as exc:  # evicted or marked bad since the query
                log.info("not replicating %s now: %s", checkpoint.path, exc)
                return None
        with pin:
            base = f"{checkpoint.stream}/{checkpoint.path.name}.{self._token}"
            with self._writable().transaction() as session:
                replica_id = ledger_replicas.add(
                    session,
                    self._reader.run_id,
                    checkpoint.id,
                    REMOTE,
                    lambda ident: str(self._remote.url_of(f"{base}.r{ident}")),
                )
            prefix = f"{base}.r{replica_id}"
            try:
                directory, total, files = self._upload(checkpoint, prefix)
            except Exception as exc:
                held = checkpoint.state != m.COMMITTED  # evicted, held for this copy
                hopeless = checkpoint if held and _bad_here(exc, checkpoint.path) else None
                self._abandon(replica_id, prefix, exc, hopeless=hopeless)
                return self._one(replica_id)
            except BaseException as exc:  # Ctrl-C: the copy is not left "uploading" here
                try:
                    self._abandon(replica_id, prefix, exc)
                except Exception as cleanup:  # noted on the interrupt, which stays raised
                    note_on(exc, f"recording the interrupted copy as failed failed too: {cleanup}")
                raise
            with self._writable().transaction() as session:
                manifest = {
                    "kind": "directory" if directory else "file",
                    "files": [[name, info.size, info.hash] for name, info in files],
                }
                if ledger_replicas.finish(
                    session, replica_id, checkpoint.id, total.size, total.hash, manifest
                ):  # its local file, if retention evicted it meanwhile, may go now
                    ledger_tiers.release(session, [checkpoint.id], REMOTE)
        return self._one(replica_id)

    def _upload(
        self, checkpoint: Checkpoint, prefix: str
    ) -> tuple[bool, FileInfo, list[tuple[str, FileInfo]]]:
        """Every file of the checkpoint, each one object under ``prefix``; refused unless
        what was sent is what the checkpoint row records. Whether it is a directory,
        the whole and each file."""
        source = checkpoint.path
        directory = source.is_dir() and not source.is_symlink()
        local = tree_files(source) if directory else [(source.name, source)]
        sent = [(name, self._upload_file(path, f"{prefix}/{name}")) for name, path in local]
        total = combine(sent) if directory else sent[0][1]
        if (total.size, total.hash) != (checkpoint.size, checkpoint.hash):
            raise CorruptCheckpointError(
                f"{checkpoint.path} does not match its ledger row (read {total.size} bytes "
                f"hashing to {total.hash}; recorded {checkpoint.size} bytes, {checkpoint.hash}); "
                "not replicated"
            )
        return directory, total, sent

    def _upload_file(self, path: Path, rel: str) -> FileInfo:
        def copy(writer: Any) -> None:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    writer.write(chunk)

        info: FileInfo = self._remote.write_object(rel, copy)
        return info

    def _abandon(
        self,
        replica_id: int,
        prefix: str,
        exc: BaseException,
        *,
        hopeless: Checkpoint | None = None,
    ) -> None:
        """A copy that failed: its objects removed, its row ``failed`` with the reason (and,
        if removing them failed too, that failure with the copy's location: recorded in
        the row and logged, never dropped).

        ``hopeless``: the checkpoint, evicted, whose local copy is gone or is not the bytes
        its row records can never be copied, so in the same transaction its file stops
        waiting for a copy (retention removes it at the writer's next commit, ``gc`` or
        reconcile, as it would have without the tier), said as a ``copy_impossible``
        event."""
        shown = f"{type(exc).__name__}: {exc}"
        try:
            self._remote.remove_tree(prefix)
        except Exception as cleanup:  # the reason stays the copy's failure
            left = (
                f"removing the partial copy at {self._remote.url_of(prefix)} failed too: {cleanup}"
            )
            note_on(exc, left)
            shown = f"{shown}; {left}"
        log.warning("replicating to %s failed: %s", self.location, shown)
        with self._writable().transaction() as session:
            ledger_replicas.fail(session, replica_id, shown)
            if hopeless is not None:
                ledger_tiers.release(session, [hopeless.id], REMOTE)
                ledger_rows.add_event(
                    session,
                    self._reader.run_id,
                    None,
                    "copy_impossible",
                    checkpoint_id=hopeless.id,
                    step=hopeless.step,
                    detail={"path": str(hopeless.path), "tier": REMOTE, "error": shown},
                )
        if hopeless is not None:
            log.warning(
                "ckptdb: %s (step %d) was evicted and cannot be copied: it no longer waits "
                "for its copy",
                hopeless.path,
                hopeless.step,
            )

    def _sweep_interrupted(self) -> list[Replica]:
        """Copies a replicator left ``uploading`` when it died: their uploads aborted and
        objects removed, their rows ``failed`` (the next pass copies them again).
        Copies it left ``deleting`` are removed by the next :meth:`_expire`."""
        with self._writable().transaction() as session:
            left = ledger_replicas.unfinished(session, self._reader.run_id, REMOTE)
            found = [(row.id, row.location) for row in left]
        for replica_id, location in found:
            prefix = self._remote.rel_of(location) if location else None
            if prefix is not None:
                self._remote.remove_tree(prefix)
            with self._writable().transaction() as session:
                ledger_replicas.fail(session, replica_id, ledger_replicas.INTERRUPTED)
        return [self._one(replica_id) for replica_id, _ in found]

    def _sweep_failed(self, *, at_start: bool) -> list[Replica]:
        """Remove what failed copies left under their prefixes: objects that landed after
        the copy was marked ``failed``. Each failed copy is swept until
        :data:`LATE_LANDING_S` after it failed, at most every :data:`SWEEP_EVERY_S`
        (``at_start``: every one never swept, whenever it failed). The copies whose
        objects were removed, each said in a warning."""
        now = m.utcnow()
        with self._writable().transaction() as session:
            due = [
                (row.id, prefix)
                for row in ledger_replicas.in_state(
                    session, self._reader.run_id, REMOTE, ledger_replicas.FAILED
                )
                if _sweep_due(row.finished_at, row.swept_at, now, at_start)
                and (prefix := self._remote.rel_of(row.location)) is not None
            ]
        if due:
            self._still_ours()  # a failed copy's prefix may be the new machine's copy
        removed = []
        for replica_id, prefix in due:
            if self._stopping():
                break
            try:
                left = self._remote.list_under(prefix)
                if left:
                    self._remote.remove_tree(prefix)
            except Exception as exc:  # recorded on the row and logged; the next sweep retries
                where = self._remote.url_of(prefix)
                log.warning("sweeping the failed copy at %s failed: %s", where, exc)
                with self._writable().transaction() as session:
                    row = session.get(m.Replica, replica_id)
                    reason = (row.error or "").split(SWEEP_FAILED)[0] if row is not None else ""
                    # the copy's own failure stays first; the sweep's replaces the last one's
                    ledger_replicas.note_error(session, replica_id, f"{reason}{SWEEP_FAILED}{exc}")
                continue
            if left:
                log.warning(
                    "ckptdb: removed %d object(s) a failed copy left at %s (they landed after "
                    "it failed)",
                    len(left),
                    self._remote.url_of(prefix),
                )
                removed.append(replica_id)
            with self._writable().transaction() as session:
                ledger_replicas.mark_swept(session, replica_id, now)
        return [self._one(replica_id) for replica_id in removed]

    # ------------------------------------------------------------------ the tier's retention

    def _register(self) -> None:
        """Record this tier for the run: from now on local retention keeps an evicted
        checkpoint of a copied stream until its copy is whole (see ledger.tiers)."""
        records = {stream: policy.to_record() for stream, policy in self.keep.items()}
        with self._writable().transaction() as session:
            ledger_tiers.register(
                session, self._reader.run_id, REMOTE, self.location, self.streams, records
            )

    def _expire(self) -> list[Replica]:
        """Remove the copies ``keep`` no longer keeps (and those a replicator left half
        removed): each row ``deleting`` first, then its objects, then ``deleted``. A
        removal that fails is logged and recorded on the row, and retried next pass.
        Only copies under this replicator's destination are judged or removed."""
        run_id = self._reader.run_id
        with self._writable().transaction() as session:
            for stream, policy in self.keep.items():
                copies = [
                    (row, replica)
                    for row, replica in ledger_replicas.whole_copies(
                        session, run_id, REMOTE, stream
                    )
                    if self._remote.rel_of(replica.location) is not None
                ]
                ledger_replicas.mark_deleting(session, self._dropped(stream, policy, copies))
            found = [
                (row.id, prefix)
                for row in ledger_replicas.in_state(
                    session, run_id, REMOTE, ledger_replicas.DELETING
                )
                if (prefix := self._remote.rel_of(row.location)) is not None
            ]
        if found:
            self._still_ours()  # never remove copies the new machine's ledger counts on
        removed = []
        for replica_id, prefix in found:
            try:
                self._remote.remove_tree(prefix)
            except Exception as exc:  # recorded on the row and logged; the next pass retries
                where = self._remote.url_of(prefix)
                log.warning("removing the expired copy %s failed: %s", where, exc)
                with self._writable().transaction() as session:
                    ledger_replicas.note_error(session, replica_id, f"removing it failed: {exc}")
                continue
            with self._writable().transaction() as session:
                ledger_replicas.mark_deleted(session, replica_id)
            removed.append(replica_id)
        return [self._one(replica_id) for replica_id in removed]

    def _dropped(
        self, stream: str, policy: Policy, copies: list[tuple[m.Checkpoint, m.Replica]]
    ) -> list[int]:
        """The ids of the copies ``policy`` drops: replayed in the order their checkpoints
        committed. A ranked policy that needs its metric never judges a copy saved
        without it (said once): a misnamed metric must not empty the tier."""
        entries = [
            _entry(row, replica, policy) for row, replica in sorted(copies, key=lambda c: c[0].id)
        ]
        if policy.requires_metric:
            unranked = [e for e in entries if e.metric is None]
            entries = [e for e in entries if e.metric is not None]
            if unranked and stream not in self._unranked_said:
                self._unranked_said.add(stream)
                log.warning(
                    "%d copies of stream %r were saved without %r: the remote policy %s "
                    "keeps them (it ranks only copies saved with it)",
                    len(unranked),
                    stream,
                    policy.ranking_metric,
                    policy.describe(),
                )
        return [e.id for e in replayed_evictions(policy, entries)]

    # ------------------------------------------------------------------ records

    def _one(self, replica_id: int) -> Replica:
        with self._writable().transaction() as session:
            row = session.get(m.Replica, replica_id)
            assert row is not None
            return ledger_replicas.to_record(session, row)

    def _writable(self) -> Ledger:
        if self._ledger is None:
            raise CkptDBError(f"the replicator of {self.root} is closed")
        return self._ledger

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop following (after the copy in progress) and release the run's lock.

        A SQLite ledger is copied one last time first, as the last pass left it.
        Leaving the ``with`` block calls it; when the block is left by an exception,
        the thread's error is noted on that exception instead of raised.

        Raises:
            CkptDBError: the error that stopped the background thread of
                :meth:`start`, if anything did (whatever its type).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            if self._ledger is not None:  # the ledger as the last pass left it
                self._copy_ledger(force=True)
        finally:
            self._release()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _release(self) -> None:
        if self._pg_lock is not None:
            self._pg_lock.release()
            self._pg_lock = None
        if self._ledger is not None:
            self._ledger.dispose()
            self._ledger = None
        self._reader.close()
        if self._lock.is_locked:
            self._lock.release()

    def __enter__(self) -> Replicator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # the block's own error stays the one raised; the thread's is noted on it
            self.close()
        except Exception as failed:
            note_on(exc, f"the replicator's thread had stopped: {type(failed).__name__}: {failed}")


def detach(root: str | os.PathLike[str], *, db_url: str | None = None) -> int:
    """Stop treating the run at ``root`` as replicated (``ckptdb replicate --detach``).

    Its tier's registration is removed, and local retention stops waiting for
    copies. The local files that waited are removed by the writer's next commit,
    ``gc`` or reconcile; copies already made, and their rows, stay.

    Args:
        root: The run's root directory.
        db_url: The run's ledger URL when it is not the SQLite file in ``root``;
            None (the default): that file.

    Returns:
        The number of files that waited for their copy.

    Raises:
        LedgerLockedError: a replicator of the run runs: it would go on copying
            while evictions no longer wait, and its copy of a file that waited could
            be cut short by the file's removal. Stop it first.
    """
    with RunReader(root, db_url=db_url) as reader:
        lock = FileLock(str(reader.root / LOCK_NAME), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise LedgerLockedError(
                f"a replicator holds {reader.root / LOCK_NAME}: stop it before detaching"
            ) from None
        try:
            url = ledger_url(reader.root, db_url, readonly=False)
            check_ledger_location(url)
            elsewhere = _machines_lock(reader.root, url)
            ledger = open_ledger(url)
            try:
                with ledger.transaction() as session:
                    return ledger_tiers.detach(session, reader.run_id, REMOTE)
            finally:
                ledger.dispose()
                if elsewhere is not None:
                    elsewhere.release()
        finally:
            lock.release()


def _sweep_due(
    failed_at: dt.datetime | None, swept_at: dt.datetime | None, now: dt.datetime, at_start: bool
) -> bool:
    """Whether a failed copy's prefix is swept now (see :meth:`Replicator._sweep_failed`)."""
    if swept_at is None:
        return True
    late = dt.timedelta(seconds=LATE_LANDING_S)
    if failed_at is not None and swept_at - failed_at >= late:
        return False  # swept after the window closed: nothing can land any more
    return at_start or (now - swept_at).total_seconds() >= SWEEP_EVERY_S


def _ledger_copier(
    remote: Any, root: Path, url: str, token: str, run_name: str, interval: float
) -> LedgerCopier | None:
    """The copier of a SQLite ledger (a PostgreSQL ledger is the server's to keep)."""
    path = sqlite_path(url)
    if path is None:
        return None
    return LedgerCopier(remote, root, path, token=token, run_name=run_name, interval=interval)


def _machines_lock(root: Path, url: str) -> AdvisoryWriterLock | None:
    """On a PostgreSQL ledger, the run's replicator lock across machines, taken (the
    lock file covers this machine only); ``LedgerLockedError`` if another holds it."""
    if backend_name(url) != "postgresql":
        return None
    lock = replicator_lock(root, url)
    lock.acquire()
    return lock


def _remote_policies(
    keep: Mapping[str, Policy] | None, streams: list[str] | None, run: Mapping[str, Policy]
) -> dict[str, Policy]:
    """``keep`` checked: a Keep or TopK per stream of the run that is copied."""
    if keep is None:
        return {}
    if not isinstance(keep, Mapping):
        raise ArgumentTypeError(f"keep must be a dict stream -> Keep or TopK, got {keep!r}")
    for stream, policy in keep.items():
        if stream not in run:
            raise UnknownStreamError(
                f"keep names stream {stream!r}, which the run does not have "
                f"(streams: {', '.join(run)})"
            )
        if streams is not None and stream not in streams:
            raise InvalidArgumentError(
                f"keep names stream {stream!r}, which this replicator does not copy"
            )
        if isinstance(policy, type) or getattr(policy, "kind", None) not in POLICY_KINDS:
            raise ArgumentTypeError(
                f"the remote policy of stream {stream!r} must be Keep or TopK, got {policy!r}"
            )
    return dict(keep)


def _entry(row: m.Checkpoint, replica: m.Replica, policy: Policy) -> Entry:
    """A copy as the tier's policy sees it: its checkpoint's step and, for a ranked
    policy, the checkpoint's value of its metric (whatever the local stream ranks by)."""
    metric = policy.ranking_metric
    values = json.loads(row.metrics) if row.metrics else {}
    value = values.get(metric) if metric is not None else None
    if value is None or not math.isfinite(float(value)):  # NaN: not ranked, as unsaved
        return Entry(id=replica.id, step=row.step)
    return Entry(id=replica.id, step=row.step, metric=float(value))


def _bad_here(exc: BaseException, path: Path) -> bool:
    """Whether a copy failed on the local copy at ``path`` itself: not the bytes its row
    records, or gone (a read of a missing file fails inside the upload's write phase).
    Only where the directory holding it is there: a directory that is not (a disk not
    mounted yet) says nothing about the file, as reconcile reads it too."""
    if not path.parent.is_dir():
        return False
    if isinstance(exc, CorruptCheckpointError):
        return True
    cause = exc.error if isinstance(exc, PhaseError) else exc
    return isinstance(cause, FileNotFoundError)


def _check_poll(poll: object, name: str = "poll") -> None:
    if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll < math.inf:
        raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {poll!r}")


__all__ = ["MAX_FAILURES", "Replica", "Replicator", "detach"]
