"""CheckpointManager: the trainer-facing façade.

It opens a run (writer lock, migrate-on-open, attempt, reconcile) and
composes the parts that do the work, all sharing one
:class:`~ckptdb.protocol.context.RunContext`:

- :class:`~ckptdb.protocol.boundary.Publisher`: ``save`` (the boundary state
  machine, blocking or asynchronous) and ``gc``;
- :class:`~ckptdb.protocol.loading.Loader`: ``load``;
- :class:`~ckptdb.ledger.RunQueries`: ``latest``, ``best``, ``checkpoints``;
- :class:`~ckptdb.protocol.reconcile.Reconciler` and
  :class:`~ckptdb.protocol.check.Checker`.

Ranks talk through a :class:`~ckptdb.coord.base.Coordinator`: a no-op one in
a single process, the fixed collective sequence of :mod:`ckptdb.coord.dist`
under torch.distributed, where only the chief (rank 0) opens the ledger.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeGuard, TypeVar, overload

import torch.distributed as dist

from . import goodput
from .coord import Coordinator, coordinator_for
from .errors import (
    ArgumentTypeError,
    CheckpointNotFoundError,
    ChiefOnlyError,
    CleanupWarning,
    InvalidArgumentError,
    LedgerError,
    PhaseError,
    RankFailedError,
    RunDirectoryError,
    note_on,
)
from .exports.checking import check_exports
from .goodput import IntervalChoice
from .guard import NonFiniteGradGuard
from .interval import Interval, Pacing, pacing_of
from .ledger import OpenedRun, after_commit, open_ledger, pins
from .ledger import models as m
from .ledger import progress as progress_rows
from .ledger import rows as ledger_rows
from .ledger.engine import LEDGER_FILE, default_sqlite_url, normalize_url
from .ledger.lock import writer_lock
from .ledger.models import MAX_METRIC_NAME, MAX_STEP
from .ledger.netfs import check_ledger_location
from .ledger.progress import Heartbeat
from .ledger.runs import open_as_writer
from .ledgercopy import FetchedLedger, bring_back, choose_run, record_ledger_restore
from .location import (
    ObjectPath,
    check_remote_url,
    is_object_url,
    looks_like_object_url,
    object_path,
)
from .policies import Keep, Policy, validate_policies
from .preemption import DEFAULT_SIGNALS, PipelinedFlag, Preemption
from .protocol import restore as restoring
from .protocol.adopt import Adopter, Candidate
from .protocol.adopt import Outcome as AdoptOutcome
from .protocol.aliases import AliasKeeper, requested
from .protocol.asyncsave import (
    BackgroundWriter,
    InFlight,
    SaveHandle,
    Snapshotter,
    group_timeout,
)
from .protocol.boundary import Publisher
from .protocol.check import Checker, failed_copy_leftovers
from .protocol.context import METRIC_FLUSH_THRESHOLD, RunContext
from .protocol.inputs import validate_metrics, validate_step
from .protocol.loading import Loader
from .protocol.progress import HEARTBEAT_S
from .protocol.reconcile import Action, Reconciler, ReconcileReport
from .protocol.resume import restore_at_open, settle
from .record import Checkpoint, DerivedAlias
from .storage.base import PayloadStore
from .storage.files import fsync_dir, make_dir
from .storage.naming import run_token
from .storage.opening import check_options, open_store
from .storage.remote import REMOTE, remote_store

__all__ = ["CheckpointManager", "CleanupWarning"]

log = logging.getLogger("ckptdb.manager")
#: A directory above the root that cannot be fsynced, for a reason that is no fault of
#: the run: not readable by this process, or a filesystem without directory fsync.
_UNSYNCABLE_DIRECTORY = frozenset(
    {errno.EACCES, errno.EPERM, errno.EINVAL, errno.EROFS, errno.ENOTSUP, errno.EOPNOTSUPP}
)

DEFAULT_STREAMS: dict[str, Policy] = {"model": Keep(last=5)}

T = TypeVar("T")


@dataclass(frozen=True)
class _RunInfo:
    """What the chief shares with the other ranks when a distributed manager opens."""

    save_dir: Path
    policies: dict[str, Policy]
    run_id: int
    attempt_id: int
    last_reconcile: ReconcileReport


@dataclass(frozen=True)
class _StorageRequest:
    """Where the caller asked payloads to go, checked before anything is opened.

    ``location``: the explicit save directory (an :class:`ObjectPath` for
    ``s3://bucket/prefix``), None to keep the run's own; ``options``: the
    object-store options (``storage_options``), parsed once.
    """

    location: Path | None
    options: Mapping[str, object] | None

    @classmethod
    def of(
        cls, save_dir: str | os.PathLike[str] | None, options: Mapping[str, object] | None
    ) -> _StorageRequest:
        if save_dir is None or not is_object_url(save_dir):
            local = Path(save_dir).resolve() if save_dir is not None else None
            if local is not None:
                check_options(local, options)  # options on a local save_dir are refused
            return cls(local, options)
        try:
            location: Path = object_path(str(save_dir))
        except ValueError as exc:
            raise InvalidArgumentError(f"save_dir: {exc}") from None
        check_options(location, options)  # bad options are refused before anything is contacted
        return cls(location, options)

    @property
    def is_object(self) -> bool:
        return isinstance(self.location, ObjectPath)

    def store(self, save_dir: Path | None, *, probe: bool = True) -> PayloadStore:
        """The store of ``save_dir``: local, or object storage (probed unless ``probe`` is off).

        Options given without a save_dir are for the run's own, which may turn out
        local: they then configure nothing (and are not refused)."""
        assert save_dir is not None
        options = self.options if isinstance(save_dir, ObjectPath) else None
        return open_store(save_dir, options, probe=probe)


def refuse_object_root(root: object, what: str) -> None:
    """A run root is a local directory (the ledger, the lock): an ``s3://`` URL there
    would silently become a local ``./s3:/...`` tree, so it is refused, saying what to do."""
    text = str(root) if isinstance(root, (str, os.PathLike)) else ""
    if is_object_url(root) or looks_like_object_url(text):  # Path("s3://b") reads "s3:/b"
        raise InvalidArgumentError(
            f"{what} is {str(root)!r}: the run root holds the ledger and must be a local "
            "directory; to keep checkpoints on object storage, pass a local root and "
            "save_dir='s3://bucket/prefix' (CheckpointManager)"
        )


def _abandon(db: Any, lock: Any, attempt_id: int) -> None:
    """An open that failed after its attempt started: end it as failed, let go of all."""
    try:
        with db.transaction() as session:
            ledger_rows.end_attempt(session, attempt_id, "failed")
    finally:
        db.dispose()
        lock.release()


class CheckpointManager:
    """Publishes checkpoints transactionally and answers what is latest and best.

    ``root`` is the run directory; the ledger defaults to
    ``<root>/ckptdb.sqlite`` and checkpoint files to ``<root>/checkpoints``.
    Opening takes the run's writer lock, migrates the ledger, starts an
    attempt and reconciles the ledger with the disk. ``maintenance=True`` is
    for tools such as the ``ckptdb`` command: no reconcile at open (they run it
    explicitly, maybe as a dry run) and the attempt is recorded as kind
    ``maintenance``, so it does not count as a training restart.
    Without ``save_dir`` an existing run keeps the save directory it was
    created with (following the root if the run directory was moved).

    ``db_url`` puts the ledger elsewhere, e.g. ``postgresql+psycopg://user@host/db``:
    many runs then share one database, each identified by its resolved root,
    and the writer lock is a PostgreSQL advisory lock per run instead of
    ``<root>/ckptdb.lock``. A SQLite ledger on a network filesystem (NFS, SMB,
    Lustre...) is refused with :class:`~ckptdb.errors.NetworkFilesystemError`
    unless ``allow_network_sqlite`` (or ``CKPTDB_ALLOW_NETWORK_SQLITE=1``).
    Under torch.distributed (``process_group``, else the default group when
    initialized) every rank constructs the manager; only the chief opens the
    ledger, and the others' ``streams``/``save_dir``/``db_url`` are ignored.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        streams: dict[str, Policy] | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        db_url: str | None = None,
        guard: NonFiniteGradGuard | None = None,
        maintenance: bool = False,
        allow_network_sqlite: bool = False,
        process_group: Any = None,
        storage_options: Mapping[str, object] | None = None,
        remote: str | None = None,
        remote_options: Mapping[str, object] | None = None,
        interval: float | str | None = None,
        min_interval: float | None = None,
        max_interval: float | None = None,
        heartbeat: float = HEARTBEAT_S,
    ) -> None:
        check_remote_url(remote)
        pacing = pacing_of(interval, min_interval, max_interval, heartbeat)
        if remote is None and remote_options is not None:
            raise InvalidArgumentError("remote_options= goes with remote=")
        self._remote = (remote, remote_options)
        #: What the open brought back from the remote tier (``remote=``), if anything.
        self.restored_at_open: list[Checkpoint] = []
        #: The ledger an open with ``remote=`` brought back to a root that had none.
        self.ledger_restored: FetchedLedger | None = None
        if guard is not None and not isinstance(guard, NonFiniteGradGuard):
            raise ArgumentTypeError(f"guard must be a NonFiniteGradGuard, got {guard!r}")
        refuse_object_root(root, "root")
        self._storage = _StorageRequest.of(save_dir, storage_options)
        self.root = Path(root).resolve()
        self._guard = guard
        self._closed = True
        self._interval: Interval | None = None
        self._maintenance = maintenance
        if maintenance and pacing.interval is not None:
            raise InvalidArgumentError(
                "interval= is for training; a maintenance manager never saves"
            )
        self._coord: Coordinator = coordinator_for(process_group)
        self._writer = BackgroundWriter()
        self._snapshots = Snapshotter()
        self._inflight = InFlight()
        self._preemption: Preemption | None = None
        self._deadline: float | None = None  # the preemption save's, while it runs
        self.last_reconcile = ReconcileReport()

        def open_as_chief() -> _RunInfo:
            self._open_writer(streams, save_dir, db_url, maintenance, allow_network_sqlite)
            ctx = self._ctx
            return _RunInfo(
                ctx.save_dir,
                ctx.policies,
                ctx.run_id,
                ctx.attempt_id,
                self.last_reconcile,
            )

        info = self._coord.shared("open", open_as_chief)
        if not self._coord.is_chief:
            self._open_follower(info)
        try:
            self._interval = self._start_pacing(pacing)
        except BaseException:
            self._close("failed")
            raise

    def _open_follower(self, info: _RunInfo) -> None:
        """A rank other than the chief: the run as the chief opened it, no ledger."""
        self.last_reconcile = info.last_reconcile
        store = self._storage.store(info.save_dir, probe=False)
        self._assemble(
            RunContext(
                self.root,
                info.save_dir,
                info.run_id,
                info.attempt_id,
                info.policies,
                store,
                is_writer=False,
                world_size=self._coord.size,
            )
        )
        self._closed = False

    def _start_pacing(self, pacing: Pacing) -> Interval | None:
        """Heartbeats on (the chief writes them) and, with ``interval=``, the clock of
        ``due`` (collective under torch.distributed: its agreement's gloo group)."""
        ctx = self._ctx
        ctx.progress.every = pacing.heartbeat
        if ctx.is_writer and not self._maintenance:
            ctx.progress.write_with(self._write_heartbeat, busy=self._inflight.busy)
        if pacing.interval is None:
            return None
        group = self._gloo_group()
        return Interval(
            pacing.interval,
            ctx.progress,
            is_chief=ctx.is_writer,
            flag=PipelinedFlag(group) if group is not None else None,
            history=lambda: goodput.history(ctx.ledger, ctx.run_id, ctx.attempt_id),
            record=self._record_interval,
        )

    def _gloo_group(self) -> Any:
        """A small gloo group of this manager's ranks (collective), or None in one process:
        the agreements of preemption and ``due`` run on it, one byte per rank."""
        if self._coord.group is None:
            return None
        return dist.new_group(
            ranks=dist.get_process_group_ranks(self._coord.group),
            backend="gloo",
            timeout=group_timeout(self._coord.group),
            use_local_synchronization=True,
        )

    def _write_heartbeat(self, beat: Heartbeat) -> None:
        ctx = self._ctx
        with ctx.ledger.transaction(durable=False) as session:
            progress_rows.write_heartbeat(session, ctx.attempt_id, beat)

    def _record_interval(self, choice: IntervalChoice, step: int) -> None:
        """The chief records each change of the interval (never raising: every rank must
        return the same answer from ``due``, so a failure to record is logged)."""
        if not self._ctx.is_writer:
            return
        try:
            self._ctx.event("interval", step=step, detail=choice.as_dict())
        except Exception:
            log.error(
                "ckptdb: the interval change at step %d was not recorded", step, exc_info=True
            )

    # ------------------------------------------------------------------ opening

    def _open_writer(
        self,
        streams: dict[str, Policy] | None,
        save_dir: str | os.PathLike[str] | None,
        db_url: str | None,
        maintenance: bool,
        allow_network_sqlite: bool,
    ) -> None:
        requested = validate_policies(streams) if streams is not None else None
        explicit_save_dir = self._storage.location
        url = normalize_url(db_url) if db_url else default_sqlite_url(self.root)
        check_ledger_location(url, allow=allow_network_sqlite)
        # an object store is probed before the ledger records anything
        early = self._storage.store(explicit_save_dir) if self._storage.is_object else None
        db = open_ledger(url)  # a bad URL fails here, before anything is created
        try:
            if db_url is not None:
                db.probe()  # an unreachable ledger fails before the root is created
            self._prepare_root()
            lock = writer_lock(self.root, url)
            lock.acquire()
        except BaseException:
            db.dispose()
            raise
        try:
            if db_url is None:  # a lost machine's run comes back with its ledger first
                self.ledger_restored = self._bring_back_ledger()
        except BaseException:
            db.dispose()
            lock.release()
            raise
        try:
            run: OpenedRun = open_as_writer(
                db,
                self.root,
                requested,
                explicit_save_dir,
                adopt_single=db_url is None,
                kind="maintenance" if maintenance else "train",
                default_streams=DEFAULT_STREAMS,
                world_size=self._coord.size,
            )
        except BaseException:
            db.dispose()
            lock.release()
            raise
        assert run.attempt_id is not None
        try:
            store = early if early is not None else self._storage.store(run.save_dir)
            if not store.renames:  # the run's own names (see storage.naming.run_token)
                assert run.created_at is not None
                store.run_token = run_token(run.name, run.run_id, run.created_at)
        except BaseException:
            _abandon(db, lock, run.attempt_id)
            raise
        ctx = RunContext(
            self.root,
            run.save_dir,
            run.run_id,
            run.attempt_id,
            run.policies,
            store,
            is_writer=True,
            db=db,
            lock=lock,
            world_size=self._coord.size,
        )
        db.fenced = lambda: lock.lost  # every later write asks the lock first
        self._assemble(ctx)
        self._closed = False
        try:
            record_ledger_restore(ctx)
            ctx.remote, ctx.remote_tier = self._remote_tier(run.save_dir), REMOTE
            if not maintenance:
                if ctx.remote is not None:
                    self.restored_at_open = restore_at_open(ctx, REMOTE)
                self.last_reconcile = self.reconcile()
                settle(ctx)
        except BaseException:
            self._close("failed")
            raise

    def _bring_back_ledger(self) -> FetchedLedger | None:
        """With ``remote=`` and no ledger in the root: the ledger of the run named as the
        root, from its replica on the remote tier, if there is one (see
        :mod:`ckptdb.ledgercopy`); a run never replicated there starts anew."""
        url, options = self._remote
        db_path = self.root / LEDGER_FILE
        if url is None or db_path.exists():
            return None
        remote = remote_store(url, options, probe=False)
        token = choose_run(remote, self.root.name)
        if token is None:
            return None
        fetched = bring_back(remote, self.root, db_path, token)
        log.warning(
            "ckptdb: %s had no ledger; brought back the copy of %s made at %s (%s)",
            self.root,
            fetched.run,
            fetched.copied_at,
            fetched.location,
        )
        return fetched

    def _remote_tier(self, save_dir: Path | ObjectPath) -> Any:
        """The store of ``remote=`` (the tier a replicator copies to), read only: a load
        that finds its local copy missing or corrupt falls back to its copy there."""
        url, options = self._remote
        if url is None:
            return None
        if isinstance(save_dir, ObjectPath):
            raise InvalidArgumentError(
                f"remote= is the tier a local run is replicated to; {self.root} saves on "
                f"object storage already ({save_dir})"
            )
        return remote_store(url, options, probe=False)

    def _assemble(self, ctx: RunContext) -> None:
        """Compose the parts around one run context."""
        self._ctx = ctx
        self._publisher = Publisher(
            ctx, self._coord, self._guard, self._writer, self._snapshots, self._inflight
        )
        self._loader = Loader(ctx, self._coord, self._inflight)

    def _prepare_root(self) -> None:
        make_dir(self.root)
        if not self.root.is_dir():
            raise RunDirectoryError(f"the run root {self.root} is not a directory")
        self._root_entry_durable()

    def _root_entry_durable(self) -> None:
        """fsync the directories above the root, up to its filesystem's mount point: a
        root someone else made (a framework's ``os.makedirs``, the user's ``mkdir -p``)
        may have no durable entry yet, and a power cut would then take the whole run,
        ledger and checkpoints, with it. A directory this process may not open, or a
        filesystem that cannot fsync a directory, is logged, not fatal: the entries
        there are as durable as whoever made them left them."""
        device = os.stat(self.root).st_dev
        for directory in self.root.parents:
            try:
                if os.stat(directory).st_dev != device:
                    return  # the mount point was the last one
                fsync_dir(directory)
            except (OSError, PhaseError) as exc:
                error = exc.error if isinstance(exc, PhaseError) else exc
                if getattr(error, "errno", None) not in _UNSYNCABLE_DIRECTORY:
                    raise RunDirectoryError(
                        f"cannot make the run root {self.root} durable in {directory}: {error}"
                    ) from exc
                log.warning(
                    "cannot fsync %s (%s): the run root's entries above it are as durable "
                    "as whoever made them left them",
                    directory,
                    error,
                )
                return

    # ------------------------------------------------------------- run identity

    @property
    def guard(self) -> NonFiniteGradGuard | None:
        """The guard read once per boundary (it may be replaced between boundaries)."""
        return self._guard

    @guard.setter
    def guard(self, guard: NonFiniteGradGuard | None) -> None:
        if guard is not None and not isinstance(guard, NonFiniteGradGuard):
            raise ArgumentTypeError(f"guard must be a NonFiniteGradGuard, got {guard!r}")
        self._guard = guard
        if hasattr(self, "_publisher"):
            self._publisher.guard = guard

    @property
    def save_dir(self) -> Path:
        return self._ctx.save_dir

    @property
    def policies(self) -> dict[str, Policy]:
        return self._ctx.policies

    @property
    def run_id(self) -> int:
        return self._ctx.run_id

    @property
    def attempt_id(self) -> int:
        return self._ctx.attempt_id

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close("closed" if exc_type is None else "failed")

    def close(self) -> None:
        """Flush buffered metrics, end the attempt and release the writer lock."""
        self._close("closed")

    def _close(self, end_state: str) -> None:
        """Not collective: a rank failing on its own must still be able to close.

        A boundary in flight finishes first (commits or rolls back); its error,
        if nobody fetched it, is raised once the manager is closed, unless the
        manager is closing because of another exception (then it was logged).
        An attempt whose ranks agreed on a preemption ends ``preempted``.
        The preemption handlers go last: a signal that comes while the attempt
        ends is recorded by them, so the attempt is never left ``running``
        (:meth:`Preemption.close` says what became of it).
        """
        if self._closed:
            return
        handle = self._inflight.handle
        preemption, self._preemption = self._preemption, None
        if preemption is not None and preemption.agreed_step is not None:
            end_state = "preempted"
        try:
            try:
                self._inflight.wait()
            finally:
                self._closed = True
                if self._interval is not None:
                    self._interval.close()
                self._inflight.handle = None
                self._snapshots.release()
                try:
                    if self._ctx.is_writer:
                        self._end_attempt(end_state)
                finally:
                    self._writer.shutdown()
        finally:
            if preemption is not None:
                preemption.close()
        error = handle.unfetched_error if handle is not None else None
        if error is not None and end_state in ("closed", "preempted"):
            assert handle is not None
            handle.mark_fetched()
            raise error

    def _settle_before_close(self) -> None:
        """A boundary whose COMMIT's answer was lost, decided before the attempt ends;
        if the ledger still cannot be read, the next open's reconcile decides it
        (a pending row with its files is rolled back, a committed one stands)."""
        try:
            self._publisher.settle()
        except LedgerError as exc:
            log.error(
                "ckptdb: %d boundary(ies) with a lost COMMIT answer are left to the next "
                "open's reconcile: %s",
                len(self._publisher.unsettled),
                exc,
            )

    def _end_attempt(self, end_state: str) -> None:
        """End the attempt, write the buffered metrics, remove what pins held back.

        Not for a writer another one took the run from (its lock was given up):
        the run is the other writer's, which already ended this attempt as
        ``crashed``; the buffered metrics are dropped, and said so."""
        ctx = self._ctx
        assert ctx.lock is not None
        if ctx.lock.lost is not None:
            log.warning(
                "ckptdb: the end of attempt %s and its last buffered metrics were not recorded: %s",
                ctx.attempt_id,
                ctx.lock.lost,
            )
            ctx.ledger.dispose()
            ctx.lock.release()
            return
        try:
            self._settle_before_close()
            with ctx.ledger.transaction() as session:
                flushed = ctx.metrics.insert_into(session, ctx.run_id, ctx.attempt_id, None)
                ledger_rows.end_attempt(session, ctx.attempt_id, end_state, ctx.progress.beat())
                # files whose pins went since the last commit go now, not at the next open
                released = self._publisher.unpinned(session, [])
                pins.clear_stale(session, ctx.run_id, m.utcnow())
                after_commit(session, lambda: ctx.metrics.drop(flushed))
                after_commit(session, lambda: self._publisher.clean_up(None, released))
        finally:
            ctx.ledger.dispose()
            assert ctx.lock is not None
            ctx.lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerError(f"the CheckpointManager for {self.root} is closed")

    def _require_chief(self, what: str) -> RunContext:
        self._check_open()
        if not self._ctx.is_writer:
            raise ChiefOnlyError(
                f"{what} works on the ledger, which only the chief (rank 0) opens; "
                f"this is rank {self._coord.rank}"
            )
        return self._ctx

    # ------------------------------------------------------------------- reading

    def latest(self, stream: str = "model") -> Checkpoint | None:
        """The newest committed checkpoint of ``stream`` (by publication, not by mtime)."""
        self._check_open()
        return self._coord.shared("latest", lambda: self._ctx.queries().latest(stream))

    def best(self, stream: str = "best") -> list[Checkpoint]:
        """The members of a top-K stream, best first."""
        self._check_open()
        return self._coord.shared("best", lambda: self._ctx.queries().best(stream))

    def checkpoints(
        self, stream: str | None = None, *, states: Iterable[str] = (m.COMMITTED,)
    ) -> list[Checkpoint]:
        """Checkpoints (committed ones unless ``states`` says otherwise), by stream then step."""
        self._check_open()
        wanted = tuple(states)
        return self._coord.shared(
            "checkpoints", lambda: self._ctx.queries().checkpoints(stream, states=wanted)
        )

    def load(
        self,
        which: str | int | Checkpoint | os.PathLike[str] = "latest",
        *,
        stream: str | None = None,
        map_location: Any = "cpu",
        weights_only: bool = True,
        into: dict[str, Any] | None = None,
        missing_keys: Literal["error", "keep"] = "error",
    ) -> Any:
        """Load a committed checkpoint after verifying its size and hash.

        ``which`` is ``"latest"``, ``"best"``, a step, a :class:`Checkpoint`
        or a path. ``stream`` defaults to ``"best"`` for ``which="best"`` and
        ``"model"`` otherwise. A mismatch marks the row ``corrupt``, moves the
        latest pointer back to the newest healthy checkpoint and raises
        :class:`~ckptdb.errors.CorruptCheckpointError` before anything is
        unpickled; a vanished file is marked ``lost`` likewise
        (:class:`~ckptdb.errors.CheckpointLostError`). A sharded checkpoint
        loads in place into ``into`` (the caller's state dict, with the shapes
        and sharding to fill), which is returned. Under torch.distributed
        ``load`` is collective: the chief resolves and verifies, every rank
        loads that checkpoint.

        A sharded checkpoint saved on another number of ranks reshards through
        DCP. Before anything loads, every rank checks the keys and global
        shapes it asks for against the checkpoint: a key it lacks (the
        per-rank entry of a rank the saving job did not have) raises
        :class:`~ckptdb.errors.LayoutMismatchError` on every rank, unless
        ``missing_keys="keep"``, which leaves those values as they are in
        ``into``; another shape always raises (see docs/distributed.md).
        """
        self._check_open()
        return self._loader.load(which, stream, map_location, weights_only, into, missing_keys)

    def verify(
        self,
        which: str | int | Checkpoint | os.PathLike[str] = "latest",
        *,
        stream: str | None = None,
    ) -> Checkpoint:
        """The committed checkpoint ``which`` names, its size and hash checked, not loaded.

        For frameworks that read their checkpoints themselves (a Hugging Face
        ``checkpoint-N/`` directory, Accelerate's ``load_state``): resolve and
        verify exactly as :meth:`load` does, then hand the path over. A
        mismatch is recorded the same way (``corrupt`` or ``lost``, latest
        falls back) and raised. Collective under torch.distributed.
        """
        self._check_open()
        if self._inflight.writes(Loader._stream_of(which, stream)):
            self._inflight.wait()
        return self._coord.shared("resolve", lambda: self._loader.verified(which, stream))

    # ------------------------------------------------------------------- saving

    @overload
    def save(
        self,
        step: int,
        *,
        metrics: Mapping[str, float] | None = ...,
        blocking: Literal[True] = ...,
        **payloads: Any,
    ) -> dict[str, Checkpoint]: ...

    @overload
    def save(
        self,
        step: int,
        *,
        metrics: Mapping[str, float] | None = ...,
        blocking: Literal[False],
        **payloads: Any,
    ) -> SaveHandle: ...

    def save(
        self,
        step: int,
        *,
        metrics: Mapping[str, float] | None = None,
        blocking: bool = True,
        **payloads: Any,
    ) -> dict[str, Checkpoint] | SaveHandle:
        """Publish one boundary: every payload (keyed by stream) commits, or none does.

        Returns the committed checkpoints by stream; a top-K candidate that
        would not enter its top-K is not written and is absent from the result.
        A payload wrapped in :class:`~ckptdb.Sharded` is written with
        ``torch.distributed.checkpoint`` as a directory (every rank its shards).
        Under torch.distributed every rank calls ``save`` with the same step,
        metrics and streams (see :mod:`ckptdb.coord.dist`).

        ``blocking=False`` returns a :class:`~ckptdb.protocol.asyncsave.SaveHandle`
        once the payload is copied to host memory; the write and the commit
        finish in the background. This call first waits for the previous
        boundary, and raises its error if nobody fetched it.
        """
        self._check_open()
        deadline = self._deadline if blocking else None
        with self._ctx.progress.saving() as timed:
            saved = self._publisher.save(step, metrics, payloads, blocking, deadline=deadline)
            timed.wrote = saved != {}  # a top-K candidate not admitted is no sample of C
            return saved

    def heartbeat(self, step: int) -> None:
        """Report that training finished ``step``: goodput's measure of progress.

        Cheap (two assignments; at most every ``heartbeat`` seconds one small
        UPDATE, without fsync). :meth:`due` reports it too; call this one when
        something else decides when to checkpoint. The first report ends the
        attempt's restart time; the last one before a crash is its end.
        """
        self._check_open()
        if self._maintenance:
            raise InvalidArgumentError("heartbeat() is for training; this manager is maintenance")
        self._ctx.progress.step(validate_step(step))

    def due(self, step: int) -> bool:
        """Whether to checkpoint at ``step``: ``interval=`` seconds (or the automatic
        interval) have passed since the last save, or since training began.

        Call it once per step, on every rank, with the same ``step``; every
        rank gets the same answer at the same call (see :mod:`ckptdb.interval`).
        It reports the step like :meth:`heartbeat`.

        Raises:
            InvalidArgumentError: the manager was made without ``interval=``, or
                ``step`` is not a valid step.
        """
        self._check_open()
        if self._interval is None:
            raise InvalidArgumentError(
                "due() needs interval= (seconds, or 'auto') when the CheckpointManager is made"
            )
        at = validate_step(step)
        self._ctx.progress.step(at)
        return self._interval.due(at)

    @property
    def interval(self) -> IntervalChoice | None:
        """The interval ``due`` uses now and why (the chief's; None before the first
        ``due``, and on other ranks, which follow the chief's answers)."""
        return self._interval.current if self._interval is not None else None

    def protect(self, checkpoint: Checkpoint) -> None:
        """Never remove ``checkpoint``'s file while this manager is open.

        For the checkpoint a run resumed from (Lightning protects it the same
        way): retention still evicts it from its stream when its policy says
        so, but then the row is marked ``deleted`` with a note and the file is
        left on disk, no longer ckptdb's. On ranks other than the chief (which
        never remove anything) it does nothing.
        """
        self._check_open()
        if not isinstance(checkpoint, Checkpoint):
            raise ArgumentTypeError(f"protect() takes a committed Checkpoint, got {checkpoint!r}")
        self._ctx.protected.add(checkpoint.id)

    @property
    def is_chief(self) -> bool:
        """Whether this process is the chief: the rank that opened the ledger (rank 0 of
        the group; True in one process). Integrations write a framework's derived
        files (aliases, pointers) from the chief only."""
        self._check_open()
        return self._coord.is_chief

    def preemption(
        self,
        *,
        signals: Iterable[signal.Signals | int] = DEFAULT_SIGNALS,
        grace: float | None = None,
        every: int = 1,
    ) -> Preemption:
        """Treat ``signals`` (default SIGTERM) as "this job is being preempted".

        Collective under torch.distributed (every rank calls it; it makes the
        small gloo group the agreement runs on). Installs handlers that only
        record the signal; ``stop.requested(step)``, called once per step on
        every rank, says when every rank must save that step and stop, the same
        answer at the same step everywhere; ``stop.save(step, **payloads)`` is
        that checkpoint, an ordinary guarded boundary rolled back if ``grace``
        seconds (counted from the first signal) run out before its commit. The
        attempt then ends ``preempted``. Under several ranks the agreement runs
        every ``every`` steps (default 1: a signal is acted on within two
        steps). Closing the manager restores the previous handlers. See
        :mod:`ckptdb.preemption` and docs/preemption.md.
        """
        self._check_open()
        if self._preemption is not None:
            raise InvalidArgumentError("this CheckpointManager already handles preemption")
        group = self._gloo_group()
        self._preemption = Preemption(
            self.save,
            self._record_preemption,
            self._deadline_scope,
            signals=signals,
            grace=grace,
            every=every,
            group=group,
        )
        return self._preemption

    @contextlib.contextmanager
    def _deadline_scope(self, deadline: float | None) -> Iterator[None]:
        """Every blocking boundary begun inside is rolled back if ``deadline``
        (``time.time()``) passes before its commit: the preemption save's grace
        period, reaching an integration's own publish path unchanged."""
        previous, self._deadline = self._deadline, deadline
        try:
            yield
        finally:
            self._deadline = previous

    def _record_preemption(self, kind: str, step: int, detail: dict[str, Any]) -> None:
        """The chief records a preemption event at once, in its own transaction."""
        if self._ctx.is_writer:
            self._ctx.event(kind, step=step, detail=detail)

    def gc(self) -> list[Checkpoint]:
        """Apply every stream's stored retention policy now (e.g. after lowering ``last``)."""
        self._require_chief("gc()")
        self._inflight.wait()  # its pending rows are not a crash
        return self._publisher.gc()

    def adopt(
        self,
        candidates: Iterable[Candidate],
        *,
        move: bool = False,
        report: Callable[[AdoptOutcome], None] | None = None,
    ) -> list[AdoptOutcome]:
        """Commit rows for checkpoints that already sit at their final names (``ckptdb adopt``).

        Each candidate (a file or directory a framework wrote, with the stream,
        step and metrics its layout read) is measured and committed in a
        transaction of its own, without retention: adopting never evicts. A
        stream the run lacks is created as ``Keep(last=None)``. See
        :mod:`ckptdb.protocol.adopt` for the rules; ``move`` moves a checkpoint
        that lies outside the save directory into it first.
        """
        self._require_chief("adopt()")
        self._inflight.wait()  # its pending rows are not ours to judge
        return Adopter(self._ctx).run(candidates, move=move, report=report)

    def derive_aliases(
        self,
        aliases: Mapping[str | os.PathLike[str], tuple[str, str]] | Iterable[DerivedAlias],
        *,
        replace: bool = False,
    ) -> list[Action]:
        """Register names other tools open, and point each at its stream's latest now.

        ``aliases``: :class:`~ckptdb.record.DerivedAlias` values, or a mapping of
        path to ``(stream, kind)``. A path is relative to the run root and stays in
        it; ``kind`` is ``"symlink"`` (a relative symbolic link), ``"pointer"`` (a
        text file holding the checkpoint's path relative to the pointer's
        directory) or ``"link"`` (a hard link, a copy where links are not possible).
        They are recorded in the ledger (a path registered again takes the new
        stream and kind; ``replace`` forgets the run's other aliases, leaving their
        files as they are), so that every reconcile re-points them: a crash between
        a commit and its aliases no longer leaves them stale. Each is pointed at
        the latest committed checkpoint of its stream now, atomically (an alias of
        a stream with nothing committed is left as it is). Returns what was done,
        one :class:`~ckptdb.Action` per alias changed (``aliased``), and records no
        event: call it again after each commit of an aliased stream. Bad input,
        a path outside the root, a checkpoint's own name or a directory raise
        :class:`~ckptdb.errors.InvalidArgumentError` before anything changes.
        Collective under torch.distributed: only the chief writes, the others'
        ``aliases`` are ignored.
        """
        self._check_open()
        self._inflight.wait()  # the latest is the one its commit makes

        def on_chief() -> list[Action]:
            wanted = requested(aliases)
            ctx = self._ctx
            keeper = AliasKeeper(ctx.ledger, ctx.run_id, ctx.root, ctx.save_dir)
            return keeper.register(wanted, replace=replace)

        return self._coord.shared("derive_aliases", on_chief)

    # ------------------------------------------ for the integration contract
    # (ckptdb/integrations/contract.py: what integrations do, not training loops)

    def _holds(self, name: str) -> bool:
        """Whether a live row of this run owns ``name`` (relative to the save directory).

        Pending, committed, being deleted, lost or corrupt: such a name is the
        row's, and a boundary refuses to publish over it (a lost checkpoint's
        too, so that the file never comes back under another checkpoint's row).
        For integrations that choose a free name before they write.
        Collective under torch.distributed (the chief answers).
        """
        self._check_open()
        if not isinstance(name, str):
            raise ArgumentTypeError(
                f"holds() takes a name relative to the save directory, got {name!r}"
            )
        return self._coord.shared("holds", lambda: self._ctx.queries().name_in_use(name))

    def _resumed_from(self, checkpoint: Checkpoint) -> None:
        """Record that this attempt resumed from ``checkpoint``, which something else loaded.

        For frameworks that load checkpoints themselves (Lightning's
        ``fit(ckpt_path=...)``): the same record a ``load`` makes, a
        ``resumed`` event and the attempt's ``resumed_from_id``, once per
        attempt. Nothing to do on a rank other than the chief.
        """
        self._check_open()
        if not isinstance(checkpoint, Checkpoint):
            raise ArgumentTypeError(f"resumed_from() takes a Checkpoint, got {checkpoint!r}")
        if self._ctx.is_writer:
            self._loader.note_resume(checkpoint)

    def _agree(self, local: BaseException | None, *, what: str = "agree") -> None:
        """Raise on every rank if any rank failed a local step of its own; collective.

        For integrations whose framework runs a step on every rank before a
        boundary (checking its own arguments, loading a checkpoint the ledger
        chose): a rank that fails alone must not leave the others waiting in
        the next collective. Every rank calls it, whatever happened locally:
        the rank that failed raises ``local`` itself; every other rank raises
        :class:`~ckptdb.errors.RankFailedError` naming the failed ranks
        (``ranks``), with their error, rebuilt, as ``__cause__``. In one
        process ``local`` is raised as itself. ``what`` names the collective
        in errors and in the coordinator's log.
        """
        self._check_open()
        agreed = self._coord.failure(what, local)
        if local is not None:
            raise local
        if agreed is not None:
            ranks = list(getattr(agreed, "ranks", None) or [])
            # a foreign error travels as PublishError, its own type named in its message
            kind = type(agreed).__name__
            shown = str(agreed) if kind == "PublishError" else f"{kind}: {agreed}"
            where = ", ".join(map(str, ranks))
            error = RankFailedError(f"{what} failed on rank {where}: {shown}")
            error.ranks = ranks
            raise error from agreed

    def _from_chief(self, value: T, *, what: str = "share") -> T:
        """The chief's ``value``, on every rank; collective.

        For integrations whose framework decides on rank 0 alone what the next
        boundary is (DeePMD-kit's step and file names, its validation metric):
        every rank calls it at the same point, the chief's ``value`` (picklable)
        is returned everywhere and the others' is ignored. In one process it is
        ``value`` itself. ``what`` names the collective in errors and in the
        coordinator's log.
        """
        self._check_open()
        return self._coord.shared(what, lambda: value)

    def _committed_at(self, stream: str, step: int | None) -> Checkpoint | None:
        """The committed checkpoint of ``stream`` at ``step``, if any (one indexed query;
        None for no step). Collective under torch.distributed, whatever ``step`` is (the
        chief's is asked)."""
        self._check_open()

        def ask() -> Checkpoint | None:
            if step is None:
                return None
            try:
                return self._ctx.queries().resolve(step, stream)
            except CheckpointNotFoundError:
                return None

        return self._coord.shared("committed_at", ask)

    def _newest_row_at(self, rel: str) -> tuple[str, str | None] | None:
        """The state and error text of the newest row, in any state, at ``rel`` (relative
        to the save directory). Collective under torch.distributed."""
        self._check_open()
        return self._coord.shared("row_at", lambda: self._ctx.queries().newest_row_at(rel))

    # ------------------------------------------------------------------ metrics

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Buffer metric values for ``step``; written with the next commit or on flush/close.

        Under torch.distributed only the chief's metrics are recorded (as
        with Lightning's rank-zero logging): other ranks validate and drop them.
        """
        if self._closed:
            self._check_open()
        ctx = self._ctx
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            step = validate_step(step)
        checked = values if _plain_metrics(values) else validate_metrics(values)
        if ctx.is_writer and ctx.metrics.add(step, checked) >= METRIC_FLUSH_THRESHOLD:
            self.flush()

    def flush(self) -> None:
        """Write buffered metrics now (nothing to do on a rank other than the chief).

        Waits for a boundary in flight, whose commit writes the metrics
        buffered before it (never twice).
        """
        self._check_open()
        ctx = self._ctx
        if not ctx.is_writer:
            return
        self._inflight.wait()
        if not len(ctx.metrics):
            # Nothing to write: no transaction, which on SQLite takes the write lock as it
            # begins (a no-op flush would wait for, and fail on, another writer's lock).
            return
        with ctx.ledger.transaction() as session:
            flushed = ctx.metrics.insert_into(session, ctx.run_id, ctx.attempt_id, None)
            after_commit(session, lambda: ctx.metrics.drop(flushed))

    # ---------------------------------------------------------------- reconcile

    def reconcile(
        self,
        *,
        verify: bool = False,
        dry_run: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReconcileReport:
        """Compare the ledger with the payload store and repair (see ckptdb.protocol.reconcile).

        ``verify`` re-hashes every committed payload; ``dry_run`` only reports;
        ``progress(done, total)`` follows the rows checked.
        """
        ctx = self._require_chief("reconcile()")
        self._inflight.wait()  # its pending rows are not a crash
        reconciler = Reconciler(ctx.ledger, ctx.run_id, ctx.attempt_id, ctx.root, ctx.store)
        return reconciler.run(verify=verify, dry_run=dry_run, progress=progress)

    def restore(
        self,
        source: str,
        *,
        every: bool = False,
        storage_options: Mapping[str, object] | None = None,
    ) -> list[Checkpoint]:
        """Bring checkpoints back from their copies at ``source`` (``s3://...``, where a
        :class:`~ckptdb.replication.Replicator` copied them); the checkpoints restored.

        The newest checkpoint of each stream that has a whole copy (``every``:
        each one that has) is downloaded, verified against its row and put in
        place if its local copy is missing or does not match its row; its row
        is committed again (it may have been marked lost or corrupt) and
        ``latest`` re-pointed. For a new machine whose local disk is empty, open
        the run with ``maintenance=True`` (no reconcile, which would first mark
        every missing checkpoint lost; those are restored too) and restore
        before training opens it. Chief only. See docs/replication.md.
        """
        ctx = self._require_chief("restore()")
        self._inflight.wait()
        remote = remote_store(source, storage_options, probe=False)  # it only reads
        outcome = restoring.restore(ctx, remote, REMOTE, every=every)
        if outcome.failures:  # every checkpoint was tried: the first failure is raised
            (_, first), rest = outcome.failures[0], outcome.failures[1:]
            for checkpoint, exc in rest:
                note_on(first, f"restoring {checkpoint.path} failed too: {exc}")
            if outcome.restored:
                done = ", ".join(str(c.path) for c in outcome.restored)
                note_on(first, f"restored all the same: {done}")
            raise first
        return outcome.restored

    def check(self, *, load: bool = False) -> list[str]:
        """Violations of the run's consistency invariants, one line each.

        See :mod:`ckptdb.protocol.check` for the invariants; also, every recorded
        export's files are what was written (:mod:`ckptdb.exports`). With
        ``remote=``, also the objects failed copies left on the remote tier (a
        sweep removes them).
        """
        ctx = self._require_chief("check()")
        self._inflight.wait()  # its pending rows are not a crash
        found = Checker(ctx.ledger, ctx.run_id, ctx.root, ctx.store, ctx.policies).run(load=load)
        found += check_exports(ctx.ledger, ctx.run_id)
        if ctx.remote is not None:  # remote=: what failed copies left there too
            found += failed_copy_leftovers(ctx.ledger, ctx.run_id, ctx.remote, ctx.remote_tier)
        return found


def _plain_metrics(values: object) -> TypeGuard[dict[str, float]]:
    """Whether ``values`` is the common call (a dict of non-empty str -> float).

    Then ``log_metrics`` skips :func:`validate_metrics` (its ABC checks cost
    more than the rest of the call); anything else, valid or not, goes through
    it, so errors and conversions stay exactly its own. A plain loop: ``all()``
    over a generator costs twice as much per call.
    """
    if type(values) is not dict:
        return False
    for name, value in values.items():
        if type(name) is not str or not name or type(value) is not float:
            return False
        if len(name) > MAX_METRIC_NAME or not name.isascii() or "\x00" in name:
            return False  # validate_metrics checks (and words) it; isascii() is O(1)
    return True
