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

    The one object a training script holds for a run. Each :meth:`save` is one
    boundary: its payloads, keyed by stream, are written durably and then committed in
    one ledger transaction, so "latest", the top-K and retention always describe files
    that are complete on disk. Constructing the manager opens the run at ``root``: it
    takes the run's writer lock, migrates the ledger, starts an attempt and reconciles
    the ledger with the disk. It is a context manager: leaving the ``with`` block
    closes it, and leaving it by an exception ends the attempt as ``failed``.

    Under torch.distributed (``process_group``, else the default group when it is
    initialized) every rank constructs the manager, collectively; only the chief
    (rank 0) opens the ledger, and the other ranks' ``streams``, ``save_dir`` and
    ``db_url`` are ignored.

    Args:
        root: The run directory, a local path, created if missing. It holds the writer
            lock (``ckptdb.lock``) and, by default, the ledger (``ckptdb.sqlite``) and
            the checkpoints (``checkpoints/``). Opening fsyncs the directories above it
            up to its mount point, so that a root someone else made survives a power
            cut. An ``s3://`` URL is refused: for checkpoints on object storage, pass a
            local root and ``save_dir="s3://bucket/prefix"``.
        streams: Stream name -> retention policy (:class:`~ckptdb.Keep` or
            :class:`~ckptdb.TopK`). None (the default) uses the policies stored in the
            ledger; a new run gets ``{"model": Keep(last=5)}``. Given, it updates the
            named streams; a stored stream it does not name keeps its policy and its
            checkpoints. A lower ``last`` or ``k`` applies at the stream's next save
            (or :meth:`gc`). A new ranking metric (or a Keep stream made a TopK one)
            re-ranks the stream's checkpoints by their saved metrics, and is refused
            if one was saved without a finite value of it (unless the TopK has
            ``last``). A name is 1-64 letters, digits, ``_``, ``-`` or ``.`` (not
            ``.``, ``..``, ``ckptdb.*``, nor ``step``, ``metrics`` or ``blocking``,
            which are :meth:`save`'s own arguments).
        save_dir: Where checkpoint files go. None (the default): an existing run keeps
            the save directory it was created with (following the root if the run
            directory was moved), a new run uses ``<root>/checkpoints``. A local path,
            or ``"s3://bucket/prefix"`` for object storage (see docs/s3.md).
        db_url: The ledger's SQLAlchemy URL. None (the default): the SQLite file
            ``<root>/ckptdb.sqlite``. With ``postgresql+psycopg://user@host/db`` many
            runs share one database, each identified by its resolved root, and the
            writer lock is a PostgreSQL advisory lock per run instead of
            ``<root>/ckptdb.lock`` (see docs/postgres.md).
        guard: A :class:`~ckptdb.NonFiniteGradGuard`, read once per boundary: a
            boundary after a non-finite gradient is not published. None (the
            default): no guard. It can be replaced between boundaries (:attr:`guard`).
        maintenance: For tools such as the ``ckptdb`` command (default False). The
            open runs no reconcile (the tool runs it explicitly, maybe as a dry run),
            the attempt is recorded as kind ``maintenance`` so that it does not count
            as a training restart, and no heartbeat is written; :meth:`heartbeat`
            and ``interval`` are refused. Also how a new machine opens a run to
            :meth:`restore` it before training opens it.
        allow_network_sqlite: Accept a SQLite ledger on a network filesystem (NFS,
            SMB, Lustre...), where its locking is unsafe (default False: refused;
            ``CKPTDB_ALLOW_NETWORK_SQLITE=1`` also allows it).
        process_group: The torch.distributed process group of the ranks that
            checkpoint together. None (the default): the default group when
            torch.distributed is initialized, else a single process.
        storage_options: Options of the object store of an ``s3://`` ``save_dir``
            (credentials, endpoint...: see docs/s3.md), checked before anything is
            contacted. Refused with a local ``save_dir``; given without ``save_dir``,
            they configure the run's own save directory if it is on object storage,
            and nothing otherwise.
        remote: The ``s3://`` URL a :class:`~ckptdb.replication.Replicator` copies
            this run to; None (the default): none. The open then restores the newest
            copies that a missing save directory (a new machine) or missing newest
            checkpoints need (:attr:`restored_at_open`), and :meth:`load` and
            :meth:`verify` bring back the copy of a missing or corrupt local
            checkpoint. On a root without a ledger, the SQLite ledger of the run
            named as the root is first brought back from its copy there
            (:attr:`ledger_restored`). Refused for a run saved on object storage.
        remote_options: Object-store options for ``remote``, as ``storage_options``
            are for ``save_dir``; only with ``remote``.
        interval: What :meth:`due` answers by: seconds between two checkpoints, or
            ``"auto"``, the Young/Daly interval sqrt(2·C·M) chosen from this run's
            save cost and failure rate, within ``min_interval`` and ``max_interval``
            (see docs/goodput.md). None (the default): :meth:`due` is unavailable.
            Refused on a maintenance manager.
        min_interval: The lower bound of ``"auto"``, in seconds. None: 60, or
            ``max_interval`` where that is smaller. Only with ``interval``.
        max_interval: The upper bound of ``"auto"``, in seconds, and its interval
            while no failure has been seen. None: 1800, or ``min_interval`` where
            that is larger. Only with ``interval``.
        heartbeat: Seconds between two heartbeats of a loop that reports its steps
            (:meth:`due`, :meth:`heartbeat`), each one UPDATE without fsync; a crash's
            end is known within this much (default 10).

    Attributes:
        root: The run directory, resolved.
        last_reconcile: The report of the reconcile the open ran (empty for a
            maintenance manager; the chief's on other ranks).
        restored_at_open: The checkpoints the open brought back from ``remote``.
        ledger_restored: The ledger the open brought back from ``remote`` to a root
            that had none (None if it did not).

    Raises:
        InvalidArgumentError: ``root`` is an object-storage URL; ``save_dir`` is a
            malformed object-storage URL; ``storage_options`` are given with a local
            ``save_dir``, or are not valid; ``remote`` is not an object-storage URL,
            or the run saves on object storage, or it holds the ledgers of several
            runs named as the root; ``remote_options`` without ``remote``; a number
            of seconds that is not positive and finite, an ``interval`` that is
            neither seconds nor ``"auto"``, bounds that cross or bounds without an
            interval; ``interval`` on a maintenance manager; a bad stream name; a
            new ranking metric some checkpoint of its stream was saved without.
        ArgumentTypeError: ``guard`` is not a NonFiniteGradGuard; ``streams`` is not
            a non-empty dict, or a policy is not a Keep or a TopK.
        NetworkFilesystemError: a SQLite ledger on a network filesystem, unless
            ``allow_network_sqlite``.
        LedgerLockedError: another process holds the run's writer lock.
        RunDirectoryError: ``root`` is not a directory, cannot be made durable, or
            its lock file is unusable; or the save directory (or a stream directory
            in it) is missing while the ledger records committed checkpoints in it
            (storage not mounted?).
        SchemaVersionError: the ledger was written by a newer ckptdb.
        DatabaseError: the ledger cannot be reached or a database operation failed.
        ObjectStoreError: an object-storage ``save_dir`` fails its probe
            (:class:`~ckptdb.errors.ConditionalWritesUnsupportedError` when the store
            ignores ``If-None-Match: *``).
        MissingExtraError: object storage without its optional dependency
            (``pip install 'ckptdb[s3]'``).
        CorruptLedgerReplicaError: with ``remote`` on a root without a ledger, every
            copy of the ledger there is damaged.
        RankAgreementError: under torch.distributed, a collective of the open failed.
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
        """The guard read once per boundary; None when none is checked.

        It may be replaced between boundaries (the next :meth:`save` reads the new
        one), or set to None to stop guarding; setting anything else raises
        :class:`~ckptdb.errors.ArgumentTypeError`.
        """
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
        """Where the run's checkpoint files are (an object-storage path for ``s3://``)."""
        return self._ctx.save_dir

    @property
    def policies(self) -> dict[str, Policy]:
        """The run's streams and their retention policies, as the ledger stores them."""
        return self._ctx.policies

    @property
    def run_id(self) -> int:
        """The run's id in the ledger (the ``runs`` table)."""
        return self._ctx.run_id

    @property
    def attempt_id(self) -> int:
        """The id of the attempt this manager started when it opened the run."""
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
        """Flush buffered metrics, end the attempt and release the writer lock.

        An asynchronous boundary in flight finishes first (it commits or rolls back).
        Leaving the ``with`` block calls it; leaving that block by an exception ends
        the attempt as ``failed`` instead of ``closed``, and an attempt whose ranks
        agreed on a preemption ends ``preempted``. Not collective, so a rank that
        failed on its own can still close. Closing an already closed manager does
        nothing.

        Raises:
            PublishError: the error of an asynchronous boundary that nobody fetched
                (with ``result()`` or ``exception()``), raised once the manager is
                closed; any other error such a boundary ended with is raised the
                same way. When the ``with`` block is left by an exception, it is not
                raised (it was logged when it happened), so that exception is not
                masked.
        """
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
        # decided before a preemption renames the end: an exception leaving the block
        # (``Preempted`` itself, typically) must never be masked by the unfetched error
        raise_unfetched = end_state == "closed"
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
        if error is not None and raise_unfetched:
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
        """The newest committed checkpoint of ``stream``.

        Newest by publication, as the ledger's latest pointer says, not by file
        modification time: what a resume should load. It does not wait for an
        asynchronous boundary in flight: until that one commits, the answer is the
        previous checkpoint. Collective under torch.distributed (the chief answers).

        Args:
            stream: The stream asked about (default ``"model"``).

        Returns:
            The newest committed checkpoint, or None when the stream has none.

        Raises:
            UnknownStreamError: the run has no stream ``stream``.
            LedgerError: the manager is closed.
        """
        self._check_open()
        return self._coord.shared("latest", lambda: self._ctx.queries().latest(stream))

    def best(self, stream: str = "best") -> list[Checkpoint]:
        """The members of a top-K stream, best first.

        Ranked by the stream's metric (ties go to the earlier step); in a
        ``TopK(..., last=N)`` stream, the members saved without the metric come
        last, newest first. Like :meth:`latest`, it answers from what is committed
        and does not wait for a boundary in flight. Collective under
        torch.distributed (the chief answers).

        Args:
            stream: A stream kept by a :class:`~ckptdb.TopK` policy (default
                ``"best"``).

        Returns:
            The stream's committed checkpoints, best first; empty when it has none.

        Raises:
            UnknownStreamError: the run has no stream ``stream``.
            InvalidArgumentError: ``stream`` is not a TopK stream.
            LedgerError: the manager is closed.
        """
        self._check_open()
        return self._coord.shared("best", lambda: self._ctx.queries().best(stream))

    def checkpoints(
        self, stream: str | None = None, *, states: Iterable[str] = (m.COMMITTED,)
    ) -> list[Checkpoint]:
        """The run's checkpoints in the given states, by stream then step.

        Committed ones unless ``states`` says otherwise. Like :meth:`latest`, it
        answers from the ledger as it is and does not wait for a boundary in flight.
        Collective under torch.distributed (the chief answers).

        Args:
            stream: Only this stream's checkpoints; None (the default): every
                stream's.
            states: The row states wanted (default: ``committed`` only), among
                ``pending``, ``committed``, ``deleting``, ``deleted``, ``aborted``,
                ``lost`` and ``corrupt`` (see docs/ledger.md, "Checkpoint states").

        Returns:
            The matching checkpoints, ordered by stream, then by step.

        Raises:
            UnknownStreamError: the run has no stream ``stream``.
            LedgerError: the manager is closed.
        """
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

        The checkpoint is checked against the size and hash its ledger row records
        before anything is unpickled, so a damaged file is never loaded. A mismatch
        marks the row ``corrupt`` and moves the stream's latest pointer back to the
        newest healthy checkpoint; a vanished file is marked ``lost`` likewise. With
        ``remote=``, a missing or corrupt local copy is first restored from its copy
        on the remote tier and loaded. The first load of an attempt is recorded as
        the checkpoint it resumed from (a ``resumed`` event). A load of a stream an
        asynchronous boundary is writing waits for that boundary first.

        Under torch.distributed ``load`` is collective: the chief resolves and
        verifies, and every rank loads that checkpoint. A sharded checkpoint saved
        on another number of ranks reshards through DCP; before anything loads,
        every rank checks the keys and global shapes it asks for against the
        checkpoint (see docs/distributed.md).

        Args:
            which: ``"latest"`` (the default), ``"best"``, a step, a
                :class:`~ckptdb.Checkpoint`, or the path of a committed checkpoint
                in the save directory.
            stream: The stream ``which`` is looked up in. None (the default):
                ``"best"`` for ``which="best"``, ``"model"`` otherwise.
            map_location: ``torch.load``'s ``map_location`` for a file checkpoint
                (default ``"cpu"``); a sharded checkpoint loads onto the tensors of
                ``into``.
            weights_only: ``torch.load``'s ``weights_only`` (default True: only
                tensors and plain containers are unpickled).
            into: For a sharded checkpoint (required there, refused otherwise): the
                caller's state dict, with the shapes and sharding to fill, loaded in
                place; its ``Stateful`` values are asked for their state dict.
            missing_keys: What a sharded load does with a key of ``into`` the
                checkpoint lacks (the per-rank entry of a rank the saving job did not
                have): ``"error"`` (the default) raises, ``"keep"`` leaves those
                values as they are in ``into``. A tensor of another global shape
                always raises.

        Returns:
            What ``torch.load`` returns for a file checkpoint; ``into``, filled in
                place, for a sharded one.

        Raises:
            CorruptCheckpointError: the checkpoint's size or hash does not match its
                row (now marked ``corrupt``), and no copy could restore it.
            CheckpointLostError: the checkpoint's file is gone (its row is now marked
                ``lost``), and no copy could restore it.
            CheckpointNotFoundError: ``which`` names no committed checkpoint (the
                stream has none yet, none at that step, or a path that is not one).
            UnknownStreamError: the run has no stream ``stream``.
            InvalidArgumentError: ``"best"`` of a stream that is not a TopK stream; a
                step outside 0 to 2**63 - 1; ``missing_keys`` other than ``"error"``
                or ``"keep"``; ``into`` for a file checkpoint, or none for a sharded
                one; a directory a framework wrote (verified, but to be loaded with
                that framework from ``checkpoint.path``).
            ArgumentTypeError: ``which`` is none of the accepted types.
            LayoutMismatchError: a sharded load asks for a key the checkpoint lacks
                (with ``missing_keys="error"``) or a tensor of another global shape;
                raised on every rank before anything loads.
            RankFailedError: under torch.distributed, another rank failed to load
                with an error of its own.
            RankAgreementError: under torch.distributed, a collective failed.
            LedgerError: the manager is closed.
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
        ``checkpoint-N/`` directory, Accelerate's ``load_state``): it resolves and
        verifies exactly as :meth:`load` does, then hands the checkpoint over, whose
        ``path`` the framework loads. A mismatch is recorded the same way (``corrupt``
        or ``lost``, latest falls back) and raised; with ``remote=``, a missing or
        corrupt local copy is restored from its copy first. A stream an asynchronous
        boundary is writing is waited for. Collective under torch.distributed.

        Args:
            which: ``"latest"`` (the default), ``"best"``, a step, a
                :class:`~ckptdb.Checkpoint`, or the path of a committed checkpoint
                in the save directory.
            stream: The stream ``which`` is looked up in. None (the default):
                ``"best"`` for ``which="best"``, ``"model"`` otherwise.

        Returns:
            The verified checkpoint.

        Raises:
            CorruptCheckpointError: the checkpoint's size or hash does not match its
                row (now marked ``corrupt``), and no copy could restore it.
            CheckpointLostError: the checkpoint's file is gone (its row is now marked
                ``lost``), and no copy could restore it.
            CheckpointNotFoundError: ``which`` names no committed checkpoint.
            UnknownStreamError: the run has no stream ``stream``.
            InvalidArgumentError: ``"best"`` of a stream that is not a TopK stream,
                or a step outside 0 to 2**63 - 1.
            ArgumentTypeError: ``which`` is none of the accepted types.
            RankAgreementError: under torch.distributed, a collective failed.
            LedgerError: the manager is closed.
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

        Each payload is written durably under a temporary name, placed under its
        final name, and all of them are committed in one ledger transaction, which
        also moves each stream's latest pointer, applies retention and writes the
        buffered metrics. A failure before the commit rolls the whole boundary back:
        what was written is removed and the ledger is as it was. Files evicted by
        retention are removed after the commit. A top-K candidate that would not
        enter its top-K is not written at all.

        The checks run in a fixed order: bad input raises before the guard is looked
        at, and leaves the guard as it was; then the guard is checked (and reset,
        whatever happens next); only then is a non-finite ranking metric refused, so
        a diverged boundary reports its cause, the non-finite gradient, rather than
        the NaN validation loss it produced. A boundary stopped by the guard or a
        bad ranking metric still records its metrics. Under torch.distributed every
        rank calls ``save`` with the same step, metrics and streams, and every rank
        gets the same outcome (see :mod:`ckptdb.coord.dist`). The error of a
        previous asynchronous boundary that nobody fetched is raised first, before
        this call's own arguments are checked, and this boundary does not run.

        Args:
            step: The training step, an int from 0 to 2**63 - 2.
            metrics: Metric name -> real number (or a one-element real tensor),
                recorded with the checkpoints and in the run's metrics at ``step``;
                a TopK stream ranks by its metric
                (required there, unless the policy has ``last``). A name is a
                non-empty string of at most 255 characters, with no NUL and no lone
                surrogate. None (the default): no metrics.
            blocking: True (the default): return once the boundary is committed.
                False: return a :class:`~ckptdb.SaveHandle` once the payloads are
                copied to host memory; the write and the commit finish on a
                background thread. Input, the guard's verdict, top-K admission and
                the ``pending`` rows are still decided, and their errors raised,
                before ``save`` returns. At most one boundary is in flight: the next
                ``save`` waits for the previous one first.
            **payloads: Stream name -> payload, at least one: any object
                ``torch.save`` writes (typically a state dict), written as one file;
                :class:`~ckptdb.Sharded` (a state dict written with
                ``torch.distributed.checkpoint`` as a directory, every rank its own
                shards); or :class:`~ckptdb.External` (files a framework writes
                itself, published under its name; blocking only).

        Returns:
            With ``blocking=True``, the committed checkpoints by stream; a top-K
                candidate that was not admitted is absent (so the dict is empty when no
                stream admitted it). With ``blocking=False``, the boundary's
                :class:`~ckptdb.SaveHandle`, whose ``result()`` is that dict.

        Raises:
            NonFiniteGradientError: the guard saw a non-finite gradient since the
                last boundary; nothing was written, and a ``guard_tripped`` event
                names the parameters.
            PublishError: the boundary failed before its commit and was rolled back
                (``phase``: ``intent``, ``write``, ``replace``, ``commit``...;
                ``path``; ``cleanup_failures``). An object-store failure, a save
                directory that vanished, or a writer that raised is its cause.
            LedgerUnavailableError: the ledger could not be reached; the boundary
                was rolled back, training can go on and the next boundary tries
                again.
            CommitOutcomeUnknownError: the ledger stopped answering while the COMMIT
                was on its way; the files are kept and the boundary is settled when
                the ledger answers again.
            WriterLockLostError: the run's writer lock was lost (another writer
                opened the run); this manager never commits again: close it. Found
                at the commit, it is the cause of a PublishError instead.
            InvalidArgumentError: a step out of range; no payload; a payload the
                save directory's store cannot hold; an External name that is refused
                or already exists, two streams publishing one name, or an External
                payload with ``blocking=False``; a Sharded state dict whose
                ``Stateful`` value failed to give its state dict; a bad metric name.
            ArgumentTypeError: ``step`` is not an int, ``metrics`` is not a dict of
                names to real numbers, or ``blocking`` is not a bool.
            UnknownStreamError: a payload for a stream the run does not have.
            InvalidMetricError: a TopK stream's metric is missing from ``metrics``,
                or is not finite.
            RankAgreementError: under torch.distributed, a collective failed (a rank
                died or timed out).
            LedgerError: the manager is closed.
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
        UPDATE, without fsync), so it can be called every step. :meth:`due` reports
        the step too; call this one when something else decides when to checkpoint.
        The first report ends the attempt's restart time; the last one before a
        crash is its end (see docs/goodput.md).

        Args:
            step: The training step just finished, an int from 0 to 2**63 - 2.

        Raises:
            InvalidArgumentError: the manager is a maintenance one, or ``step`` is
                out of range.
            ArgumentTypeError: ``step`` is not an int.
            LedgerError: the manager is closed.
        """
        self._check_open()
        if self._maintenance:
            raise InvalidArgumentError("heartbeat() is for training; this manager is maintenance")
        self._ctx.progress.step(validate_step(step))

    def due(self, step: int) -> bool:
        """Whether to checkpoint at ``step``: the interval has passed since the last save.

        The interval is ``interval=`` seconds, or the one ``interval="auto"``
        chooses from this run's save cost and failure rate (:attr:`interval` says
        which and why), counted from the last save, or from the first step. Call it
        once per step, on every rank, with the same ``step``: every rank gets the
        same answer at the same call. Under torch.distributed the chief decides and
        its answer travels by a pipelined one-byte all-reduce, not a blocking
        collective per step, so a checkpoint is due one step after the chief saw it
        due (see :mod:`ckptdb.interval`). It reports the step like :meth:`heartbeat`.

        Args:
            step: The training step just finished, an int from 0 to 2**63 - 2.

        Returns:
            True when a checkpoint is due at ``step``.

        Raises:
            InvalidArgumentError: the manager was made without ``interval=``, or
                ``step`` is out of range.
            ArgumentTypeError: ``step`` is not an int.
            LedgerError: the manager is closed.
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
        """The interval :meth:`due` uses now, and why.

        An :class:`~ckptdb.goodput.IntervalChoice` (``seconds``, ``cost_s``,
        ``mtbf_s``, ``failures``, ``training_s``, ``why``): the chief's. None
        without ``interval=``, before the first :meth:`due`, and on other ranks,
        which follow the chief's answers.
        """
        return self._interval.current if self._interval is not None else None

    def protect(self, checkpoint: Checkpoint) -> None:
        """Never remove ``checkpoint``'s file while this manager is open.

        For the checkpoint a run resumed from (Lightning protects it the same
        way): retention still evicts it from its stream when its policy says
        so, but then the row is marked ``deleted`` with a note and the file is
        left on disk, no longer ckptdb's (yours). On ranks other than the chief
        (which never remove anything) it does nothing.

        Args:
            checkpoint: A committed checkpoint of this run, as :meth:`latest`,
                :meth:`load`'s resolution or :meth:`checkpoints` return it.

        Raises:
            ArgumentTypeError: ``checkpoint`` is not a :class:`~ckptdb.Checkpoint`.
            LedgerError: the manager is closed.
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
        """Treat ``signals`` as "this job is being preempted", and return the handle.

        Schedulers announce a preemption with a signal and a grace period; saving
        inside the signal handler is what goes wrong elsewhere. This installs
        handlers that only record the signal; ``stop.requested(step)``, called once
        per step on every rank, says when every rank must save that step and stop
        (the same answer at the same step everywhere), and
        ``stop.save(step, **payloads)`` is that checkpoint, an ordinary guarded
        boundary rolled back if the grace period runs out before its commit. The
        chief records ``preempted`` and ``preemption_saved`` events, and the attempt
        ends ``preempted``. Closing the manager restores the previous handlers.
        Collective under torch.distributed: every rank calls it, and it makes the
        small gloo group the agreement runs on. Must be called from the main thread.
        See :mod:`ckptdb.preemption` and docs/preemption.md.

        Args:
            signals: The signals that mean preemption (signal numbers or
                ``signal.Signals``); default ``(SIGTERM,)``, what Kubernetes, the
                clouds and SLURM send. SLURM's ``--signal=USR1@90`` adds SIGUSR1.
                SIGKILL and SIGSTOP cannot be handled.
            grace: Seconds, counted from the first signal, within which the
                preemption checkpoint must commit; a boundary still before its
                commit then is rolled back. None (the default): no deadline.
            every: Under torch.distributed, the agreement is launched every
                ``every`` steps (default 1: a signal is acted on within two steps);
                a larger value trades that delay for fewer small all-reduces.

        Returns:
            The handle to ask once per step, a :class:`~ckptdb.preemption.Preemption`.

        Raises:
            InvalidArgumentError: this manager already handles preemption; not called
                from the main thread; no signal, a number that is not a signal,
                SIGKILL or SIGSTOP; ``grace`` not positive and finite; ``every``
                below 1.
            ArgumentTypeError: ``signals`` is not a sequence of signal numbers,
                ``grace`` is not a number, or ``every`` is not an int.
            LedgerError: the manager is closed.
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
        """Apply every stream's stored retention policy now (e.g. after lowering ``last``).

        A lower ``last`` or ``k`` otherwise applies at the stream's next save. As in a
        boundary, one transaction marks the evicted rows ``deleting`` (moving a
        latest pointer off them), and their files are removed once it commits; a
        pinned checkpoint keeps its file until its pins are gone, and a protected one
        (:meth:`protect`) keeps it for good. A boundary in flight is waited for first.
        Chief only.

        Returns:
            The checkpoints evicted (empty when every stream is within its window).

        Raises:
            ChiefOnlyError: called on a rank other than the chief.
            DatabaseError: the ledger could not be written.
            LedgerError: the manager is closed.
        """
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

        For a run trained without ckptdb, or before it used ckptdb. Each candidate
        (a file or directory a framework wrote, with the stream, step and metrics
        its layout read) is fsynced, measured and committed in a transaction of its
        own, without retention: adopting never evicts. A stream the run lacks is
        created as ``Keep(last=None)``. Adopting only appends: a checkpoint whose
        step is not after its stream's newest committed step is skipped, so give the
        candidates oldest first. A name the ledger already knows is reported
        ``already``; partial, unreadable or ambiguous checkpoints are skipped with
        the reason, never deleted. An interrupted adoption is finished by running it
        again. See :mod:`ckptdb.protocol.adopt` for the rules. Chief only.

        Args:
            candidates: The checkpoints a layout found, as
                :class:`~ckptdb.protocol.adopt.Candidate` values.
            move: Rename a checkpoint that lies outside the save directory into it,
                under its own name, before its commit (never over an existing name,
                never across filesystems, moved back if its commit fails). False
                (the default): such a checkpoint is skipped.
            report: Called with each outcome as soon as it is final, so an error
                later still leaves a truthful account; None (the default): none.

        Returns:
            An outcome per candidate, in order (a
                :class:`~ckptdb.protocol.adopt.Outcome`): ``adopted`` (with its
                committed checkpoint), ``already`` or ``skipped``, with the reason.

        Raises:
            ChiefOnlyError: called on a rank other than the chief.
            WriterLockLostError: the run's writer lock was lost.
            DatabaseError: a commit failed (a moved checkpoint is moved back).
            LedgerError: the manager is closed.
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

        Derived aliases are names such as DeePMD's ``model.ckpt.pt`` and its
        ``checkpoint`` pointer file. They are recorded in the ledger's ``aliases``
        table, so that every reconcile re-points a stale one: a crash between a
        commit and its aliases does not leave them stale. Each is pointed at the
        latest committed checkpoint of its stream now, atomically; an alias of a
        stream with nothing committed is left as it is. It records no event: call it
        again after each commit of an aliased stream. Everything is checked before
        anything changes. Collective under torch.distributed: the chief registers
        and writes, the other ranks' ``aliases`` are ignored, and every rank gets
        the chief's answer. A boundary in flight is waited for first.

        Args:
            aliases: :class:`~ckptdb.DerivedAlias` values, or a mapping of path to
                ``(stream, kind)``. A path is relative to the run root and stays in
                it; ``kind`` is ``"symlink"`` (a relative symbolic link),
                ``"pointer"`` (a text file holding the checkpoint's path relative to
                the pointer's directory) or ``"link"`` (a hard link; a copy where
                links are not possible). A path registered again takes the new
                stream and kind.
            replace: Forget the run's other registered aliases, leaving their files
                as they are (default False: they stay registered).

        Returns:
            An action per alias changed on disk, a :class:`~ckptdb.Action` of kind
                ``aliased`` (re-pointed), ``alias_left`` (its stream has no committed
                checkpoint, so an existing file there was left as it is) or
                ``failed``.

        Raises:
            InvalidArgumentError: a path that leaves the root (absolute, ``..``, a
                directory that is a link out of it), one of ckptdb's own names or a
                checkpoint's, a missing directory, a directory at the path, a
                symlink where a pointer or link belongs, an unknown kind, a path
                given twice, or a run whose checkpoints are on object storage.
            ArgumentTypeError: ``aliases`` or one of its entries has the wrong type.
            UnknownStreamError: an alias of a stream the run does not have.
            RunDirectoryError: the disk refused to write an alias (``OSError``),
                after the others are written; it stays registered, and the next
                reconcile tries again.
            LedgerError: the manager is closed.
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

        Buffering keeps the training loop free of a ledger write per step: the values
        go into the ledger's ``metrics`` table in the next boundary's commit
        transaction, on :meth:`flush` or on close (a large buffer is flushed on its
        own). They are checked here, before anything is buffered, since a bad value
        once buffered would fail every later commit of the run. Under
        torch.distributed only the chief's metrics are recorded (as with
        Lightning's rank-zero logging): other ranks validate and drop them.

        Args:
            step: The step the values belong to, an int from 0 to 2**63 - 2.
            values: Metric name -> real number (or a one-element real tensor). A
                name is a non-empty string of at most 255 characters, with no NUL
                and no lone surrogate.

        Raises:
            InvalidArgumentError: ``step`` out of range, or a bad metric name.
            ArgumentTypeError: ``step`` is not an int, or ``values`` is not a
                mapping of names to real numbers.
            LedgerError: the manager is closed.
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
        buffered before it (never twice). With nothing buffered it opens no
        transaction at all.

        Raises:
            DatabaseError: the ledger could not be written (the values stay
                buffered).
            LedgerError: the manager is closed.
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
        """Compare the ledger with the payload store and repair what disagrees.

        The open runs it already (not for a maintenance manager). It rolls back the
        ``pending`` rows a crash left (their files removed), finishes evictions
        (unless a live pin holds the file), marks ``lost`` or ``corrupt`` a
        committed checkpoint whose file is missing or wrong, moves a latest pointer
        off such a row, removes ckptdb's own temporary files, moves a file in
        ckptdb's naming without a row to ``<root>/ckptdb.quarantine/`` (never
        deleting it), re-points derived aliases, and leaves any other file alone.
        Every action is an event; a second reconcile does nothing. See
        docs/guarantees.md. A boundary in flight is waited for first. Chief only.

        Args:
            verify: Also re-hash every committed payload (default False: presence
                and size only), marking a mismatch ``corrupt``; this can take a
                while.
            dry_run: Only report what it would do, changing nothing (default False).
            progress: Called as ``progress(done, total)`` after each ledger row is
                checked; None (the default): not called.

        Returns:
            The report: ``actions`` taken (or that would be taken), ``counts`` by
                kind, and ``str()`` for people.

        Raises:
            RunDirectoryError: the save directory, or a stream directory in it, is
                missing while the ledger records committed checkpoints in it
                (storage not mounted?); nothing was marked.
            ChiefOnlyError: called on a rank other than the chief.
            LedgerError: the manager is closed.
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
        """Bring checkpoints back from their copies at ``source``.

        ``source`` is where a :class:`~ckptdb.replication.Replicator` copied the
        run. The newest checkpoint of each stream that has a whole copy is
        downloaded, verified against its row and put in place if its local copy is
        missing or does not match its row; its row is committed again (it may have
        been marked lost or corrupt) and ``latest`` re-pointed. For a new machine
        whose local disk is empty, open the run with ``maintenance=True`` (no
        reconcile, which would first mark every missing checkpoint lost; those are
        restored too) and restore before training opens it; or open with
        ``remote=``, which restores at open. Every checkpoint is tried even when one
        fails. A boundary in flight is waited for first. Chief only. See
        docs/replication.md.

        Args:
            source: The ``s3://bucket/prefix`` URL the run was replicated to.
            every: Restore every checkpoint that has a whole copy, not only each
                stream's newest (default False).
            storage_options: The object store's options (as for an ``s3://``
                save directory); None (the default): none.

        Returns:
            The checkpoints restored (empty when every local copy was whole).

        Raises:
            ObjectStoreError: a copy could not be read; the first failure is raised
                after every checkpoint was tried, the others and what was restored
                all the same noted on it.
            CorruptCheckpointError: a downloaded copy does not match its row (raised
                the same way).
            OSError: a restored copy could not be written in place (raised the same
                way).
            InvalidArgumentError: ``source`` is not an object-storage URL, or bad
                ``storage_options``.
            ChiefOnlyError: called on a rank other than the chief.
            LedgerError: the manager is closed.
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

        Each committed file's size and hash against its row, the disk against the
        ledger (temporary files left behind, files in ckptdb's naming without a
        row), latest pointers, top-K retention, what a reconcile would do, and
        every recorded export's files against what was written (see
        :mod:`ckptdb.protocol.check` and :mod:`ckptdb.exports`). With ``remote=``,
        also the objects failed copies left on the remote tier (a replicator's
        sweep removes them). It changes nothing. A boundary in flight is waited for
        first. Chief only.

        Args:
            load: Also load every committed file with ``weights_only=True`` (default
                False), reporting one that does not load.

        Returns:
            The violations, one line each; empty when the run is consistent.

        Raises:
            ChiefOnlyError: called on a rank other than the chief.
            LedgerError: the manager is closed.
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
