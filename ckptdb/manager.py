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
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import numbers
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from . import faults, ledger
from . import models as m
from .check import Checker
from .db import Ledger, default_sqlite_url, migrate, normalize_url, open_ledger
from .errors import (
    ArgumentTypeError,
    CheckpointLostError,
    CheckpointNotFoundError,
    CleanupFailure,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidMetricError,
    LedgerError,
    NonFiniteGradientError,
    PublishError,
    RunDirectoryError,
    UnknownStreamError,
)
from .guard import NonFiniteGradGuard
from .lock import RunLock, writer_lock
from .netfs import check_ledger_location
from .policies import Entry, Keep, Policy, TopK, validate_policies
from .queries import RunQueries
from .reconcile import Reconciler, ReconcileReport
from .record import Checkpoint
from .storage import (
    FileInfo,
    PhaseError,
    checkpoint_name,
    confine,
    fsync_dir,
    hash_open_file,
    make_dir,
    place,
    remove,
    temp_name,
    write_payload,
)

log = logging.getLogger(__name__)

DEFAULT_STREAMS: dict[str, Policy] = {"model": Keep(last=5)}
METRIC_FLUSH_THRESHOLD = 100_000


class CleanupWarning(UserWarning):
    """An evicted or leftover file could not be removed (the next reconcile retries)."""


@dataclass
class _Pending:
    """One stream's share of a boundary between intent and commit."""

    stream: str
    payload: Any
    row_id: int
    final: Path
    tmp: Path
    metric: float | None
    info: FileInfo | None = None


def validate_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise ArgumentTypeError(f"step must be a non-negative int, got {step!r}")
    if step < 0:
        raise InvalidArgumentError(f"step must be >= 0, got {step}")
    return step


def validate_metrics(metrics: object) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ArgumentTypeError(f"metrics must be a dict name -> number, got {metrics!r}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"metric names must be non-empty str, got {name!r}")
        out[name] = _real(name, value)
    return out


def _real(name: str, value: object) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"metric {name!r} must be a real number, got {value!r}")
    return float(value)


class CheckpointManager(RunQueries):
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
    ) -> None:
        requested = validate_policies(streams) if streams is not None else None
        if guard is not None and not isinstance(guard, NonFiniteGradGuard):
            raise ArgumentTypeError(f"guard must be a NonFiniteGradGuard, got {guard!r}")
        self.root = Path(root).resolve()
        explicit_save_dir = Path(save_dir).resolve() if save_dir is not None else None
        self.guard = guard
        self._closed = True
        self._metric_buffer: list[tuple[int, str, float, float]] = []
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
        self.last_reconcile = ReconcileReport()
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
        if self._closed:
            return
        self._closed = True
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

    # ------------------------------------------------------------------- saving

    def save(
        self, step: int, *, metrics: Mapping[str, float] | None = None, **payloads: Any
    ) -> dict[str, Checkpoint]:
        """Publish one boundary: every payload (keyed by stream) commits, or none does.

        Returns the committed checkpoints by stream; a top-K candidate that
        would not enter its top-K is not written and is absent from the result.
        """
        self._check_open()
        step = validate_step(step)
        values = validate_metrics(metrics)
        if not payloads:
            raise InvalidArgumentError(
                "save() needs at least one payload, e.g. save(step, model=sd)"
            )
        self._check_payload_streams(payloads, values)
        now = time.time()
        self._metric_buffer.extend((step, name, v, now) for name, v in values.items())
        try:
            self._check_guard(step)
            self._check_finite_metrics(payloads, values)
            return self._publish(step, values, payloads)
        finally:
            if self.guard is not None:
                self.guard.reset()

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

    def _check_guard(self, step: int) -> None:
        if self.guard is None or not self.guard.tripped():
            return
        params = self.guard.nonfinite_parameters()
        with self._db.transaction() as session:
            ledger.add_event(
                session,
                self.run_id,
                self.attempt_id,
                "guard_tripped",
                step=step,
                detail={"parameters": params} if params else None,
            )
        which = f" in {', '.join(params)}" if params else ""
        raise NonFiniteGradientError(
            f"non-finite gradient seen{which} since the last boundary; step {step} not published",
            step=step,
            parameters=params,
        )

    def _publish(
        self, step: int, values: dict[str, float], payloads: Mapping[str, Any]
    ) -> dict[str, Checkpoint]:
        pending = self._record_intent(step, values, payloads)
        if not pending:
            return {}  # no top-K stream admitted the candidate: nothing to write
        try:
            faults.point("after_intent")
            self._write_and_place(pending)
            evicted, committed_at, flushed = self._commit(step, pending)
        except BaseException as exc:
            self._roll_back(step, pending, exc)
            raise  # _roll_back raises PublishError for ordinary errors
        # Committed: from here on nothing may roll the boundary back.
        self._drop_flushed(flushed)
        faults.point("after_commit")
        self._clean_up(step, evicted)
        return {p.stream: self._record(p, step, values, committed_at) for p in pending}

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
    ) -> list[_Pending]:
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
    ) -> _Pending:
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
        name = checkpoint_name(step)
        rel = f"{stream}/{name}"
        if ledger.path_in_use(session, self.run_id, rel) or os.path.lexists(self.save_dir / rel):
            name = checkpoint_name(step, version=row.id)
            rel = f"{stream}/{name}"
        row.path = rel
        row.tmp_path = f"{stream}/{temp_name(name, row.id)}"
        return _Pending(
            stream, payload, row.id, self.save_dir / rel, self.save_dir / row.tmp_path, metric
        )

    def _write_and_place(self, pending: list[_Pending]) -> None:
        for p in pending:
            p.info = write_payload(p.payload, p.tmp)
        faults.point("after_fsync")
        for p in pending:
            place(p.tmp, p.final)
        faults.point("after_replace")
        for directory in sorted({p.final.parent for p in pending}):
            fsync_dir(directory)
        faults.point("after_fsync_dir")

    def _commit(
        self, step: int, pending: list[_Pending]
    ) -> tuple[list[m.Checkpoint], dt.datetime, int]:
        """The single commit point of a boundary.

        Returns the rows it evicted, its time, and how many buffered metric
        points it wrote (dropped from the buffer by the caller).
        """
        evicted: list[m.Checkpoint] = []
        self._lock.verify()  # a PostgreSQL lock session may have died with its connection
        now = m.utcnow()
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
            flushed = self._flush_into(session)
            faults.point("in_commit")
        return evicted, now, flushed

    def _record(
        self, p: _Pending, step: int, values: dict[str, float], committed_at: dt.datetime
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

    def _apply_retention(self, session: Any, p: _Pending) -> list[m.Checkpoint]:
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

    def _roll_back(self, step: int, pending: list[_Pending], exc: BaseException) -> None:
        failures: list[CleanupFailure] = []
        left: set[int] = set()
        for p in pending:
            for leftover in (p.tmp, p.final):
                try:
                    remove(leftover)
                except OSError as cleanup_exc:
                    failures.append(CleanupFailure(leftover, cleanup_exc))
                    left.add(p.row_id)
        phase, path, cause = _describe(exc)
        error_text = f"{phase} failed at {path}: {type(cause).__name__}: {cause}"
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
        pending: list[_Pending],
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
        self._check_open()
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
        """Buffer metric values for ``step``; written with the next commit or on flush/close."""
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
        self._metric_buffer.extend([(step, name, v, now) for name, v in items])
        if len(self._metric_buffer) >= METRIC_FLUSH_THRESHOLD:
            self.flush()

    def flush(self) -> None:
        """Write buffered metrics now."""
        self._check_open()
        with self._db.transaction() as session:
            flushed = self._flush_into(session)
        self._drop_flushed(flushed)

    def _flush_into(self, session: Any) -> int:
        """Insert the buffer inside the caller's transaction; returns how many points.

        The caller drops them from the buffer only after its transaction
        commits, so a failed commit loses no metric.
        """
        points = self._metric_buffer
        ledger.insert_metrics(session, self.run_id, self.attempt_id, points)
        return len(points)

    def _drop_flushed(self, count: int) -> None:
        del self._metric_buffer[:count]

    # ------------------------------------------------------------------ loading

    def load(
        self,
        which: str | int | Checkpoint | os.PathLike[str] = "latest",
        *,
        stream: str | None = None,
        map_location: Any = "cpu",
        weights_only: bool = True,
    ) -> Any:
        """Load a committed checkpoint after verifying its size and hash.

        ``which`` is ``"latest"``, ``"best"``, a step, a :class:`Checkpoint`
        or a path. ``stream`` defaults to ``"best"`` for ``which="best"`` and
        ``"model"`` otherwise. A mismatch marks the row ``corrupt``, moves the
        latest pointer back to the newest healthy checkpoint and raises
        :class:`CorruptCheckpointError` before anything is unpickled; a
        vanished file is marked ``lost`` likewise (:class:`CheckpointLostError`).
        """
        self._check_open()
        target = self._resolve(which, stream)
        path = confine(self.save_dir, target.path.relative_to(self.save_dir))
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed by the with below)
        except FileNotFoundError as exc:
            self._mark_bad(target, m.LOST, "file missing")
            raise CheckpointLostError(
                f"{target.path} is gone; marked lost, latest falls back to the previous one"
            ) from exc
        with f:
            problem = self._verify_open_file(f, target)
            if problem is not None:
                self._mark_bad(target, m.CORRUPT, problem)
                raise CorruptCheckpointError(f"{target.path}: {problem}; refusing to load it")
            # torch's own reader on the path is ~3x faster than through a Python
            # file object; the file is ours, in the save dir, verified just now.
            state = torch.load(path, map_location=map_location, weights_only=weights_only)
        self._note_resume(target)
        return state

    def _resolve(self, which: object, stream: str | None) -> Checkpoint:
        if isinstance(which, Checkpoint):
            return self._committed_by_path(which.path)
        if which == "latest":
            found = self.latest(stream or "model")
            if found is None:
                raise CheckpointNotFoundError(f"stream {stream or 'model'!r} has no checkpoint yet")
            return found
        if which == "best":
            best = self.best(stream or "best")
            if not best:
                raise CheckpointNotFoundError(f"stream {stream or 'best'!r} has no checkpoint yet")
            return best[0]
        if isinstance(which, int) and not isinstance(which, bool):
            name = stream or "model"
            self._check_stream(name)
            found = self._find_committed(stream=name, step=which)
            if found is None:
                raise CheckpointNotFoundError(
                    f"stream {name!r} has no committed checkpoint at step {which}"
                )
            return found
        if isinstance(which, (str, os.PathLike)):
            return self._committed_by_path(Path(which))
        raise ArgumentTypeError(
            f"which must be 'latest', 'best', a step, a Checkpoint or a path; got {which!r}"
        )

    def _committed_by_path(self, path: Path) -> Checkpoint:
        resolved = (Path.cwd() / path).resolve()
        save_dir = self.save_dir.resolve()
        found = None
        if resolved.is_relative_to(save_dir):
            found = self._find_committed(path=resolved.relative_to(save_dir).as_posix())
        if found is None:
            raise CheckpointNotFoundError(
                f"{path} is not a committed checkpoint of run {self.root}"
            )
        return found

    def _find_committed(self, **where: Any) -> Checkpoint | None:
        """The newest committed row matching ``where`` (column=value), by an indexed query."""
        with self._db.transaction() as session:
            query = select(m.Checkpoint).filter_by(run_id=self.run_id, state=m.COMMITTED, **where)
            row = session.scalars(query.order_by(m.Checkpoint.id.desc()).limit(1)).first()
            return Checkpoint.from_row(row, self.save_dir) if row is not None else None

    @staticmethod
    def _verify_open_file(f: Any, target: Checkpoint) -> str | None:
        size = os.fstat(f.fileno()).st_size
        if size != target.size:
            return f"size {size} != recorded {target.size}"
        actual = hash_open_file(f)
        if actual.hash != target.hash:
            return f"hash {actual.hash} != recorded {target.hash}"
        return None

    def _mark_bad(self, target: Checkpoint, state: str, problem: str) -> None:
        """Record a lost/corrupt file found at load time, as reconcile would."""
        with self._db.transaction() as session:
            ledger.set_state(session, [target.id], state, error=problem)
            ledger.repoint_latest(session, self.run_id, target.stream)
            ledger.add_event(
                session,
                self.run_id,
                self.attempt_id,
                state,
                checkpoint_id=target.id,
                step=target.step,
                detail={"path": str(target.path), "detail": problem},
            )

    def _note_resume(self, target: Checkpoint) -> None:
        if self._resumed:
            return
        self._resumed = True
        with self._db.transaction() as session:
            attempt = session.get(m.Attempt, self.attempt_id)
            if attempt is not None and attempt.resumed_from_id is None:
                attempt.resumed_from_id = target.id
            ledger.add_event(
                session,
                self.run_id,
                self.attempt_id,
                "resumed",
                checkpoint_id=target.id,
                step=target.step,
            )

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
        self._check_open()
        reconciler = Reconciler(self._db, self.run_id, self.attempt_id, self.root, self.save_dir)
        return reconciler.run(verify=verify, dry_run=dry_run, progress=progress)

    def check(self, *, load: bool = False) -> list[str]:
        """Violations of the run's consistency invariants, one line each (see ckptdb.check)."""
        self._check_open()
        checker = Checker(self._db, self.run_id, self.root, self.save_dir, self.policies)
        return checker.run(load=load)


def _describe(exc: BaseException) -> tuple[str, Path | None, BaseException]:
    """(phase, path, underlying error) of a failure inside a boundary."""
    if isinstance(exc, PhaseError):
        return exc.phase, exc.path, exc.error
    if isinstance(exc, (SQLAlchemyError, LedgerError)):
        return "commit", None, exc
    return "write", None, exc
