"""CheckpointManager: the trainer-facing API and the publication protocol.

A boundary (one :meth:`CheckpointManager.save`) runs these steps in order:

1. **Preflight** — validate step, streams and metrics; check the guard once
   (a trip records ``guard_tripped`` and raises, nothing written); decide
   top-K admission, so a candidate that would not enter is never written.
2. **Intent** — one transaction inserts a ``pending`` row per stream, with
   its final and temporary path (a name no live row owns).
3. **Write** — ``torch.save`` into the temporary file in the destination
   directory, hashing and counting bytes as they stream out; ``fsync``.
4. **Place** — ``os.replace`` onto the final name; ``fsync`` the directory.
5. **Commit** — one transaction: rows become ``committed``, latest pointers
   move, retention marks evicted rows ``deleting``, buffered metrics and
   events are written. This is the single commit point.
6. **Clean up** — unlink evicted files and mark them ``deleted``. A failure
   here does not undo the commit: it is recorded (``cleanup_failed``),
   warned about, and retried by the next reconcile.

A failure in 2-5 rolls the boundary back: files written are removed, rows
become ``aborted`` with the error, pointers and retention are untouched, and
:class:`~ckptdb.errors.PublishError` names the phase and the path. A leftover
that cannot be removed is attached to the error and stays ``pending`` so the
next reconcile removes it.

``save(blocking=False)`` runs 1-2 and a snapshot at call time and 3-6 in the
background (:mod:`ckptdb.asyncsave`); under torch.distributed the same steps
run inside a fixed sequence of collectives (:mod:`ckptdb.distributed`,
:mod:`ckptdb.collective`); ``load`` lives in :mod:`ckptdb.loading`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

from sqlalchemy.exc import SQLAlchemyError

from . import faults, ledger
from . import models as m
from .asyncsave import BackgroundWriter, SaveHandle, Snapshotter, finished
from .boundary import (
    Pending,
    PhaseFailure,
    describe,
    validate_metrics,
    validate_step,
)
from .check import Checker
from .collective import CollectiveMixin
from .db import Ledger, default_sqlite_url, migrate, normalize_url, open_ledger
from .distributed import (
    RankGroup,
    resolve_group,
)
from .errors import (
    ArgumentTypeError,
    ChiefOnlyError,
    CkptDBError,
    CleanupFailure,
    InvalidArgumentError,
    InvalidMetricError,
    LedgerError,
    NonFiniteGradientError,
    PublishError,
    RunDirectoryError,
    UnknownStreamError,
)
from .guard import NonFiniteGradGuard
from .loading import LoadingMixin
from .lock import RunLock, writer_lock
from .netfs import check_ledger_location
from .policies import Entry, Keep, Policy, TopK, validate_policies
from .reconcile import Reconciler, ReconcileReport
from .record import Checkpoint
from .sharded import Sharded, write_sharded
from .storage import (
    PhaseError,
    checkpoint_name,
    confine,
    fsync_dir,
    make_dir,
    place,
    remove,
    seal_directory,
    temp_name,
    write_payload,
)

log = logging.getLogger(__name__)

DEFAULT_STREAMS: dict[str, Policy] = {"model": Keep(last=5)}
METRIC_FLUSH_THRESHOLD = 100_000


class CleanupWarning(UserWarning):
    """An evicted or leftover file could not be removed (the next reconcile retries)."""


@dataclass(frozen=True)
class _RunInfo:
    """What the chief shares with the other ranks when a distributed manager opens."""

    save_dir: Path
    policies: dict[str, Policy]
    run_id: int
    attempt_id: int
    last_reconcile: ReconcileReport


def _resolve_sharded(payloads: Mapping[str, Any]) -> None:
    """Resolve the ``Stateful`` values of sharded payloads now (see Sharded.resolved)."""
    assert isinstance(payloads, dict)  # the **payloads of this call, ours to update
    for stream, payload in payloads.items():
        if isinstance(payload, Sharded):
            try:
                payloads[stream] = payload.resolved()
            except Exception as exc:
                raise InvalidArgumentError(
                    f"stream {stream!r}: the Sharded state dict could not be resolved "
                    f"(a Stateful's state_dict() raised {type(exc).__name__}: {exc})"
                ) from exc


class CheckpointManager(CollectiveMixin, LoadingMixin):
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
    ) -> None:
        if guard is not None and not isinstance(guard, NonFiniteGradGuard):
            raise ArgumentTypeError(f"guard must be a NonFiniteGradGuard, got {guard!r}")
        self.root = Path(root).resolve()
        self.guard = guard
        self._closed = True
        self._metric_buffer: list[tuple[int, str, float, float]] = []
        self._inflight: SaveHandle | None = None
        self._inflight_streams: frozenset[str] = frozenset()
        self._writer = BackgroundWriter()
        self._snapshots = Snapshotter()
        self._group = resolve_group(process_group)
        self.last_reconcile = ReconcileReport()

        def open_as_writer() -> _RunInfo:
            self._open_writer(streams, save_dir, db_url, maintenance, allow_network_sqlite)
            return _RunInfo(
                self.save_dir, self.policies, self.run_id, self.attempt_id, self.last_reconcile
            )

        if self._group is None:
            open_as_writer()
            return
        # Collective: the chief opens (lock, migrate, reconcile) and shares the run;
        # other ranks never touch the ledger. Their streams/save_dir/db_url are ignored.
        info = self._group.shared_call("open", open_as_writer)
        if not self._group.is_chief:
            self.save_dir, self.policies = info.save_dir, info.policies
            self.run_id, self.attempt_id = info.run_id, info.attempt_id
            self.last_reconcile = info.last_reconcile
            self._closed = False

    def _open_writer(
        self,
        streams: dict[str, Policy] | None,
        save_dir: str | os.PathLike[str] | None,
        db_url: str | None,
        maintenance: bool,
        allow_network_sqlite: bool,
    ) -> None:
        requested = validate_policies(streams) if streams is not None else None
        explicit_save_dir = Path(save_dir).resolve() if save_dir is not None else None
        url = normalize_url(db_url) if db_url else default_sqlite_url(self.root)
        check_ledger_location(url, allow=allow_network_sqlite)
        self._db: Ledger = open_ledger(url)  # a bad URL fails here, before anything is created
        try:
            if db_url is not None:
                self._db.probe()  # an unreachable ledger fails before the root is created
            self._prepare_root()
            self._lock: RunLock = writer_lock(self.root, url)
            self._lock.acquire()
        except BaseException:
            self._db.dispose()
            raise
        try:
            self._open(
                requested,
                explicit_save_dir,
                adopt_single=db_url is None,
                kind="maintenance" if maintenance else "train",
            )
        except BaseException:
            self._release_after_failed_open()
            raise
        self._closed = False
        if not maintenance:
            try:
                self.last_reconcile = self.reconcile()
            except BaseException:
                self._close("failed")
                raise

    def _open(
        self,
        requested: dict[str, Policy] | None,
        save_dir: Path | None,
        *,
        adopt_single: bool,
        kind: str,
    ) -> None:
        try:
            self._open_in_ledger(requested, save_dir, adopt_single=adopt_single, kind=kind)
        except SQLAlchemyError as exc:
            raise LedgerError(
                f"cannot use the ledger of {self.root}: {' '.join(str(exc).split()[:12])}"
            ) from exc

    def _open_in_ledger(
        self,
        requested: dict[str, Policy] | None,
        save_dir: Path | None,
        *,
        adopt_single: bool,
        kind: str,
    ) -> None:
        migrate(self._db.engine)
        with self._db.transaction() as session:
            run = ledger.open_run(session, self.root, save_dir, adopt_single=adopt_single)
            self.save_dir = Path(run.save_dir)
            self.run_id = run.id
            self.policies = ledger.sync_streams(session, run.id, requested, DEFAULT_STREAMS)
            self.attempt_id = ledger.start_attempt(session, run.id, kind).id
            ledger.add_event(session, run.id, self.attempt_id, "attempt_started")
        self._resumed = False

    def _prepare_root(self) -> None:
        make_dir(self.root)
        if not self.root.is_dir():
            raise RunDirectoryError(f"the run root {self.root} is not a directory")

    def _release_after_failed_open(self) -> None:
        self._db.dispose()
        self._lock.release()

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
        """
        if self._closed:
            return
        handle = self._inflight
        try:
            self._wait_inflight()
        finally:
            self._closed = True
            self._inflight = None
            self._snapshots.release()
            try:
                if self._is_writer:
                    self._end_attempt(end_state)
            finally:
                self._writer.shutdown()
        error = handle.unfetched_error if handle is not None else None
        if error is not None and end_state == "closed":
            handle.mark_fetched()  # type: ignore[union-attr]
            raise error

    def _end_attempt(self, end_state: str) -> None:
        try:
            with self._db.transaction() as session:
                flushed = self._flush_into(session)
                ledger.end_attempt(session, self.attempt_id, end_state)
            self._drop_flushed(flushed)
        finally:
            self._db.dispose()
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerError(f"the CheckpointManager for {self.root} is closed")

    @property
    def _is_writer(self) -> bool:
        """Whether this process owns the ledger (single process, or the chief)."""
        return self._group is None or self._group.is_chief

    def _require_chief(self, what: str) -> None:
        self._check_open()
        if not self._is_writer:
            raise ChiefOnlyError(
                f"{what} works on the ledger, which only the chief (rank 0) opens; "
                f"this is rank {self._group.rank if self._group else 0}"
            )

    # ------------------------------------------------------------------- reading

    def latest(self, stream: str = "model") -> Checkpoint | None:
        if self._group is None:
            return super().latest(stream)
        return self._group.shared_call(
            "latest", lambda: super(CheckpointManager, self).latest(stream)
        )

    def best(self, stream: str = "best") -> list[Checkpoint]:
        if self._group is None:
            return super().best(stream)
        return self._group.shared_call("best", lambda: super(CheckpointManager, self).best(stream))

    def checkpoints(
        self, stream: str | None = None, *, states: Iterable[str] = (m.COMMITTED,)
    ) -> list[Checkpoint]:
        if self._group is None:
            return super().checkpoints(stream, states=states)
        wanted = tuple(states)
        return self._group.shared_call(
            "checkpoints",
            lambda: super(CheckpointManager, self).checkpoints(stream, states=wanted),
        )

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
        metrics and streams (see :mod:`ckptdb.distributed`).

        ``blocking=False`` returns a :class:`~ckptdb.asyncsave.SaveHandle` once
        the payload is copied to host memory; the write and the commit finish
        in the background (see :mod:`ckptdb.asyncsave`). This call first waits
        for the previous boundary, and raises its error if nobody fetched it.
        """
        self._check_open()
        if self._group is not None:  # every check is part of the preflight agreement
            previous, unfetched = self._settle_previous()
            return self._save_collective(
                self._group, step, metrics, payloads, blocking, previous, unfetched
            )
        if not isinstance(blocking, bool):
            raise ArgumentTypeError(f"blocking must be True or False, got {blocking!r}")
        self._await_previous()
        values = self._validate_boundary(step, metrics, payloads)
        try:
            trip = self._guard_verdict(step)
            if trip is not None:
                self._record_guard_trip(step, trip.parameters)
                raise trip
            self._check_finite_metrics(payloads, values)
            if not blocking:
                return self._publish_async(step, values, payloads)
            return self._publish(step, values, payloads)
        finally:
            if self.guard is not None:
                self.guard.reset()

    def _validate_boundary(
        self,
        step: object,
        metrics: object,
        payloads: Mapping[str, Any],
        *,
        buffer: bool = True,
    ) -> dict[str, float]:
        """Bad input, checked before the guard (which a typo must not reset).

        Metrics of a valid boundary are buffered even if it is then refused:
        a NaN loss at a diverged step is history too. (Under torch.distributed
        the chief buffers them once the ranks agreed the input is valid.)
        """
        step = validate_step(step)
        values = validate_metrics(metrics)
        if not payloads:
            raise InvalidArgumentError(
                "save() needs at least one payload, e.g. save(step, model=sd)"
            )
        self._check_payload_streams(payloads, values)
        _resolve_sharded(payloads)
        if buffer:
            self._buffer_boundary_metrics(step, values)
        return values

    def _buffer_boundary_metrics(self, step: int, values: dict[str, float]) -> None:
        now = time.time()
        self._metric_buffer.extend((step, name, v, now) for name, v in values.items())

    def _check_payload_streams(self, payloads: Mapping[str, Any], values: dict[str, float]) -> None:
        """Bad input (checked before the guard, which a typo must not reset)."""
        for stream in payloads:
            policy = self.policies.get(stream)
            if policy is None:
                raise UnknownStreamError(
                    f"no stream {stream!r} is configured (streams: {', '.join(self.policies)})"
                )
            if isinstance(policy, TopK) and policy.metric not in values:
                raise InvalidMetricError(
                    f"stream {stream!r} ranks by metric {policy.metric!r}, which is missing "
                    f"from save(metrics=...) (got {sorted(values)})"
                )

    def _check_finite_metrics(self, payloads: Mapping[str, Any], values: dict[str, float]) -> None:
        """A non-finite ranking metric (checked after the guard: a tripped guard is the
        root cause of a NaN validation loss, and the more useful error)."""
        for stream in payloads:
            policy = self.policies[stream]
            if isinstance(policy, TopK) and not math.isfinite(values[policy.metric]):
                raise InvalidMetricError(
                    f"stream {stream!r} ranks by metric {policy.metric!r}, which must be "
                    f"finite; got {values[policy.metric]!r}"
                )

    def _guard_verdict(self, step: int) -> NonFiniteGradientError | None:
        """This process's guard verdict for the boundary (one host sync), not yet recorded."""
        if self.guard is None or not self.guard.tripped():
            return None
        params = self.guard.nonfinite_parameters()
        which = f" in {', '.join(params)}" if params else ""
        return NonFiniteGradientError(
            f"non-finite gradient seen{which} since the last boundary; step {step} not published",
            step=step,
            parameters=params,
        )

    def _record_guard_trip(
        self, step: int, params: list[str], ranks: list[int] | None = None
    ) -> None:
        detail: dict[str, object] = {"parameters": params} if params else {}
        if ranks is not None:
            detail["ranks"] = ranks
        with self._db.transaction() as session:
            ledger.add_event(
                session,
                self.run_id,
                self.attempt_id,
                "guard_tripped",
                step=step,
                detail=detail or None,
            )

    def _publish(
        self, step: int, values: dict[str, float], payloads: Mapping[str, Any]
    ) -> dict[str, Checkpoint]:
        pending = self._record_intent(step, values, payloads)
        if not pending:
            return {}  # no top-K stream admitted the candidate: nothing to write
        return self._complete(step, values, pending, None)

    def _complete(
        self,
        step: int,
        values: dict[str, float],
        pending: list[Pending],
        metric_limit: int | None,
    ) -> dict[str, Checkpoint]:
        """Write, place, commit, clean up: everything after the intent (maybe in the
        background, where ``metric_limit`` bounds the buffered metrics it commits)."""
        try:
            faults.point("after_intent")
            self._write_payloads(pending, None)
            self._place(pending)
            evicted, committed_at, flushed = self._commit(step, pending, metric_limit)
        except BaseException as exc:
            self._roll_back(step, pending, exc)
            raise  # _roll_back raises PublishError for ordinary errors
        # Committed: from here on nothing may roll the boundary back.
        self._drop_flushed(flushed)
        faults.point("after_commit")
        self._clean_up(step, evicted)
        return {p.stream: self._record(p, step, values, committed_at) for p in pending}

    # ------------------------------------------------------ asynchronous saving

    def _publish_async(
        self, step: int, values: dict[str, float], payloads: Mapping[str, Any]
    ) -> SaveHandle:
        """Intent now, snapshot now, the rest on the background worker (see ckptdb.asyncsave)."""
        pending = self._record_intent(step, values, payloads)
        if not pending:
            return finished(step, {})
        self._snapshot(step, pending)
        limit = len(self._metric_buffer)  # this boundary's metrics; later ones wait for a flush
        handle = self._writer.submit(step, lambda: self._complete(step, values, pending, limit))
        self._inflight, self._inflight_streams = handle, frozenset(p.stream for p in pending)
        return handle

    def _snapshot(self, step: int, pending: list[Pending]) -> None:
        """Replace each payload by its host copy; a failure rolls the boundary back."""
        try:
            for p in pending:
                p.payload = self._snapshots.snapshot(p.stream, p.payload)
        except Exception as exc:
            self._roll_back(step, pending, PhaseFailure("snapshot", exc))
            raise  # unreachable: _roll_back raised PublishError
        except BaseException as exc:
            self._roll_back(step, pending, exc)  # Ctrl-C stays Ctrl-C, after the rollback
            raise

    def _await_previous(self) -> None:
        """Wait for the boundary in flight; raise its error if nobody fetched it."""
        handle = self._inflight
        if handle is None:
            return
        handle.wait()
        self._inflight = None
        error = handle.unfetched_error
        if error is not None:
            handle.mark_fetched()
            raise error

    def _settle_previous(self) -> tuple[BaseException | None, bool]:
        """Wait for the boundary in flight: (its error, whether nobody fetched it here).

        Under torch.distributed the ranks then agree on raising it (see save)."""
        handle = self._inflight
        if handle is None:
            return None, False
        handle.wait()
        self._inflight = None
        unfetched = handle.unfetched_error is not None
        handle.mark_fetched()
        return handle.outcome_error(), unfetched

    def _wait_inflight(self) -> None:
        """Wait for the boundary in flight (its error stays with its handle)."""
        if self._inflight is not None:
            self._inflight.wait()

    def _admitted(
        self, session: Any, step: int, values: dict[str, float], payloads: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The payloads worth writing: top-K candidates that would not enter are dropped."""
        admitted = dict(payloads)
        for stream in payloads:
            policy = self.policies[stream]
            if isinstance(policy, TopK):
                rows = ledger.rows_in_state(session, self.run_id, [m.COMMITTED], stream)
                candidate = Entry(id=-1, step=step, metric=values[policy.metric])
                if not policy.admits(ledger.entries(rows), candidate):
                    del admitted[stream]
        return admitted

    def _record_intent(
        self, step: int, values: dict[str, float], payloads: Mapping[str, Any]
    ) -> list[Pending]:
        """One transaction: decide top-K admission, insert a pending row per admitted stream."""
        try:
            with self._db.transaction(durable=False) as session:
                admitted = self._admitted(session, step, values, payloads)
                for stream in admitted:
                    make_dir(self.save_dir / stream)
                return [self._intent_row(session, step, values, s, p) for s, p in admitted.items()]
        except PhaseError as exc:
            raise PublishError(
                f"step {step}: could not create {exc.path}: {exc.error}",
                phase="intent",
                step=step,
                path=exc.path,
            ) from exc.error
        except SQLAlchemyError as exc:
            raise PublishError(
                f"step {step}: could not record the intent in the ledger: {exc}",
                phase="intent",
                step=step,
            ) from exc

    def _intent_row(
        self, session: Any, step: int, values: dict[str, float], stream: str, payload: Any
    ) -> Pending:
        policy = self.policies[stream]
        metric = values[policy.metric] if isinstance(policy, TopK) else None
        row = m.Checkpoint(
            run_id=self.run_id,
            stream=stream,
            step=step,
            attempt_id=self.attempt_id,
            path="",
            state=m.PENDING,
            metric=metric,
            metrics=json.dumps(values) if values else None,
            created_at=m.utcnow(),
        )
        session.add(row)
        session.flush()
        sharded = isinstance(payload, Sharded)
        name = checkpoint_name(step, sharded=sharded)
        rel = f"{stream}/{name}"
        if ledger.path_in_use(session, self.run_id, rel) or os.path.lexists(self.save_dir / rel):
            name = checkpoint_name(step, version=row.id, sharded=sharded)
            rel = f"{stream}/{name}"
        row.path = rel
        row.tmp_path = f"{stream}/{temp_name(name, row.id)}"
        if sharded:  # made here, before any rank enters the DCP collective
            make_dir(self.save_dir / row.tmp_path)
        return Pending(
            stream, payload, row.id, self.save_dir / rel, self.save_dir / row.tmp_path, metric
        )

    def _write_payloads(self, pending: list[Pending], group: RankGroup | None) -> None:
        """Write every payload durably under its temporary name and record size and hash.

        Sharded payloads come first: under torch.distributed every rank is in
        the same DCP collective for them (the chief alone then writes plain
        payloads, while the others wait at the ``write`` agreement).
        """
        for p in sorted(pending, key=lambda p: not p.sharded):
            if p.sharded:
                if group is None:  # under torch.distributed the ranks wrote it already
                    write_sharded(p.payload.state_dict, p.tmp, None)
                p.info = seal_directory(p.tmp)
            else:
                p.info = write_payload(p.payload, p.tmp)
        faults.point("after_fsync")

    def _place(self, pending: list[Pending]) -> None:
        for p in pending:
            place(p.tmp, p.final)
        faults.point("after_replace")
        for directory in sorted({p.final.parent for p in pending}):
            fsync_dir(directory)
        faults.point("after_fsync_dir")

    def _commit(
        self, step: int, pending: list[Pending], metric_limit: int | None = None
    ) -> tuple[list[m.Checkpoint], dt.datetime, int]:
        """The single commit point of a boundary.

        Returns the rows it evicted, its time, and how many buffered metric
        points it wrote (dropped from the buffer by the caller).
        """
        evicted: list[m.Checkpoint] = []
        self._lock.verify()  # a PostgreSQL lock session may have died with its connection
        now = m.utcnow()
        try:
            with self._db.transaction() as session:
                for p in pending:
                    assert p.info is not None
                    ledger.set_state(
                        session,
                        [p.row_id],
                        m.COMMITTED,
                        size=p.info.size,
                        hash=p.info.hash,
                        committed_at=now,
                        tmp_path=None,
                    )
                    evicted.extend(self._apply_retention(session, p))
                    ledger.set_latest(session, self.run_id, p.stream, p.row_id)
                flushed = self._flush_into(session, metric_limit)
                faults.point("in_commit")
        except (SQLAlchemyError, CkptDBError):
            raise
        except Exception as exc:  # whatever it is, it failed the commit phase
            raise PhaseFailure("commit", exc) from exc
        return evicted, now, flushed

    def _record(
        self, p: Pending, step: int, values: dict[str, float], committed_at: dt.datetime
    ) -> Checkpoint:
        assert p.info is not None
        return Checkpoint(
            stream=p.stream,
            step=step,
            path=p.final,
            size=p.info.size,
            hash=p.info.hash,
            metric=p.metric,
            state=m.COMMITTED,
            committed_at=committed_at,
            id=p.row_id,
            attempt_id=self.attempt_id,
            metrics=dict(values),
        )

    def _apply_retention(self, session: Any, p: Pending) -> list[m.Checkpoint]:
        rows = ledger.rows_in_state(session, self.run_id, [m.COMMITTED], p.stream)
        others = [r for r in rows if r.id != p.row_id]
        new = Entry(id=p.row_id, step=self._step_of(rows, p.row_id), metric=p.metric)
        doomed = {e.id for e in self.policies[p.stream].evictions(ledger.entries(others), new)}
        evicted = [r for r in others if r.id in doomed]
        # deleted_at records the eviction (the file goes later, maybe at a reconcile)
        ledger.set_state(session, [r.id for r in evicted], m.DELETING, deleted_at=m.utcnow())
        return evicted

    @staticmethod
    def _step_of(rows: list[m.Checkpoint], row_id: int) -> int:
        return next(r.step for r in rows if r.id == row_id)

    def _roll_back(self, step: int, pending: list[Pending], exc: BaseException) -> None:
        failures: list[CleanupFailure] = []
        left: set[int] = set()
        for p in pending:
            for leftover in (p.tmp, p.final):
                try:
                    remove(leftover)
                except OSError as cleanup_exc:
                    failures.append(CleanupFailure(leftover, cleanup_exc))
                    left.add(p.row_id)
        phase, path, cause = describe(exc)
        where = f" at {path}" if path is not None else ""
        if isinstance(cause, CkptDBError) and getattr(cause, "ranks", None):
            what = str(cause)  # another rank's failure, already described
        else:
            what = f"{type(cause).__name__}: {cause}"
        error_text = f"{phase} failed{where}: {what}"
        self._record_rollback(step, pending, left, error_text, failures, phase)
        for failure in failures:
            warnings.warn(f"ckptdb could not {failure}", CleanupWarning, stacklevel=4)
        if not isinstance(exc, Exception):
            return  # KeyboardInterrupt & co. propagate unchanged after the cleanup
        stream = next((p.stream for p in pending if path in (p.tmp, p.final)), None)
        raise PublishError(
            f"step {step} not published: {error_text}",
            phase=phase,
            step=step,
            path=path,
            stream=stream,
            cleanup_failures=failures,
        ) from cause

    def _record_rollback(
        self,
        step: int,
        pending: list[Pending],
        left: set[int],
        error: str,
        failures: list[CleanupFailure],
        phase: str,
    ) -> None:
        """Mark rows aborted (or leave them pending for reconcile if files remain)."""
        try:
            with self._db.transaction() as session:
                aborted = [p.row_id for p in pending if p.row_id not in left]
                ledger.set_state(session, aborted, m.ABORTED, error=error)
                for row_id in left:
                    ledger.set_state(session, [row_id], m.PENDING, error=error)
                ledger.add_event(
                    session,
                    self.run_id,
                    self.attempt_id,
                    "publish_failed",
                    step=step,
                    detail={"phase": phase, "error": error},
                )
                for failure in failures:
                    ledger.add_event(
                        session,
                        self.run_id,
                        self.attempt_id,
                        "cleanup_failed",
                        step=step,
                        detail={"path": str(failure.path), "error": repr(failure.error)},
                    )
        except SQLAlchemyError as db_exc:
            # Rows stay pending; the next reconcile rolls them back.
            failures.append(
                CleanupFailure(
                    Path(self._db.engine.url.database or str(self._db.engine.url)),
                    db_exc,
                    action="record the rollback (rows stay pending for reconcile) in",
                )
            )

    def gc(self) -> list[Checkpoint]:
        """Apply every stream's stored retention policy now (e.g. after lowering ``last``).

        Same two steps as a boundary: one transaction marks the evicted rows
        ``deleting`` (and moves a latest pointer off them), then the files go.
        """
        self._require_chief("gc()")
        self._wait_inflight()  # its pending rows are not a crash
        evicted: list[m.Checkpoint] = []
        with self._db.transaction() as session:
            for stream, policy in self.policies.items():
                rows = ledger.rows_in_state(session, self.run_id, [m.COMMITTED], stream)
                doomed = {e.id for e in policy.window_evictions(ledger.entries(rows))}
                chosen = [r for r in rows if r.id in doomed]
                ledger.set_state(session, [r.id for r in chosen], m.DELETING, deleted_at=m.utcnow())
                ledger.repoint_latest(session, self.run_id, stream)
                evicted.extend(chosen)
        self._clean_up(None, evicted)
        return [Checkpoint.from_row(r, self.save_dir) for r in evicted]

    def _clean_up(self, step: int | None, evicted: list[m.Checkpoint]) -> None:
        if not evicted:
            return
        removed: list[int] = []
        failures: list[tuple[m.Checkpoint, Path, BaseException]] = []
        for row in evicted:
            path = self.save_dir / row.path
            try:
                remove(confine(self.save_dir, row.path))
                removed.append(row.id)
                faults.point("mid_cleanup")
            except (OSError, InvalidArgumentError) as err:
                failures.append((row, path, err))
        try:
            with self._db.transaction(durable=False) as session:
                ledger.set_state(session, removed, m.DELETED)
                for row, path, error in failures:
                    ledger.add_event(
                        session,
                        self.run_id,
                        self.attempt_id,
                        "cleanup_failed",
                        checkpoint_id=row.id,
                        step=step,
                        detail={"path": str(path), "error": repr(error)},
                    )
        except SQLAlchemyError as db_exc:
            warnings.warn(
                f"ckptdb could not record the cleanup of step {step}: {db_exc}; "
                "the next reconcile finishes it",
                CleanupWarning,
                stacklevel=3,
            )
        for _row, path, error in failures:
            warnings.warn(
                f"ckptdb could not remove evicted checkpoint {path}: {error}; it stays "
                "'deleting' and the next reconcile retries",
                CleanupWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ metrics

    def log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        """Buffer metric values for ``step``; written with the next commit or on flush/close.

        Under torch.distributed only the chief's metrics are recorded (as
        with Lightning's rank-zero logging): other ranks validate and drop them.
        """
        self._check_open()
        if type(step) is not int or step < 0:
            step = validate_step(step)
        now = time.time()
        # Fast path for the common call (a dict of str -> float): no per-value ABC checks.
        if type(values) is dict and all(
            type(n) is str and n and type(v) is float for n, v in values.items()
        ):
            items = values.items()
        else:
            items = validate_metrics(values).items()
        if not self._is_writer:
            return
        self._metric_buffer.extend([(step, name, v, now) for name, v in items])
        if len(self._metric_buffer) >= METRIC_FLUSH_THRESHOLD:
            self.flush()

    def flush(self) -> None:
        """Write buffered metrics now (nothing to do on a rank other than the chief).

        Waits for a boundary in flight, whose commit writes the metrics
        buffered before it (never twice).
        """
        self._check_open()
        if not self._is_writer:
            return
        self._wait_inflight()
        with self._db.transaction() as session:
            flushed = self._flush_into(session)
        self._drop_flushed(flushed)

    def _flush_into(self, session: Any, limit: int | None = None) -> int:
        """Insert the buffer inside the caller's transaction; returns how many points.

        The caller drops them from the buffer only after its transaction
        commits, so a failed commit loses no metric.
        """
        points = self._metric_buffer if limit is None else self._metric_buffer[:limit]
        ledger.insert_metrics(session, self.run_id, self.attempt_id, points)
        return len(points)

    def _drop_flushed(self, count: int) -> None:
        del self._metric_buffer[:count]

    # ---------------------------------------------------------------- reconcile

    def reconcile(
        self,
        *,
        verify: bool = False,
        dry_run: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReconcileReport:
        """Compare the ledger with the disk and repair (design section 4).

        ``verify`` re-hashes every committed file; ``dry_run`` only reports;
        ``progress(done, total)`` follows the rows checked.
        """
        self._require_chief("reconcile()")
        self._wait_inflight()  # its pending rows are not a crash
        reconciler = Reconciler(self._db, self.run_id, self.attempt_id, self.root, self.save_dir)
        return reconciler.run(verify=verify, dry_run=dry_run, progress=progress)

    def check(self, *, load: bool = False) -> list[str]:
        """Violations of the run's consistency invariants, one line each (see ckptdb.check)."""
        self._require_chief("check()")
        self._wait_inflight()  # its pending rows are not a crash
        checker = Checker(self._db, self.run_id, self.root, self.save_dir, self.policies)
        return checker.run(load=load)
