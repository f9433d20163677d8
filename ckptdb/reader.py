"""Read-only access to a run: for the CLI, notebooks and dashboards.

A reader takes no writer lock, starts no attempt and never reconciles, so it
works while a trainer holds the run. It changes nothing the trainer owns; the
two things it may write are its own rows, each in a short transaction on a
connection of its own: pins (leases that keep a checkpoint's file on disk
while it is read) and evaluations (values computed for a checkpoint). SQLite ledgers are opened with
``mode=ro`` and ``PRAGMA query_only`` (a write is refused by SQLite itself, not
by inspecting the statement), each query runs in one snapshot transaction,
and only committed data is visible (WAL readers never see a transaction in
progress). PostgreSQL readers run every transaction as ``REPEATABLE READ,
READ ONLY``: one snapshot of committed data, and the server refuses writes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from . import goodput
from .errors import (
    ArgumentTypeError,
    CheckpointLostError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    LedgerError,
    note_on,
)
from .exports import ExportResult, Written, export_payload
from .exports import Options as ExportOptions
from .exports import check_target as check_export_target
from .exports.writing import DEFAULT_MAX_SHARD_SIZE
from .goodput import GoodputReport
from .ledger import Ledger, RunQueries, evaluations, open_ledger, pins, replicas, rows, tiers
from .ledger import exports as ledger_exports
from .ledger import models as m
from .ledger.engine import LEDGER_FILE
from .ledger.follow import Follower
from .ledger.netfs import check_ledger_location
from .ledger.queries import run_sql
from .ledger.runs import ledger_beside, ledger_url, open_as_reader, run_exists
from .location import is_object_url, relative_within
from .pinning import Pin
from .policies import Policy
from .record import Checkpoint, Export, Replica
from .storage.opening import open_verified_payload

__all__ = ["RunReader", "ledger_url", "resolve", "run_exists"]

#: How often a follower of a SQLite ledger looks for new checkpoints (seconds).
POLL_INTERVAL = 0.5


class RunReader:
    """Queries one run's ledger without writing anything."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        db_url: str | None = None,
        storage_options: Mapping[str, object] | None = None,
    ) -> None:
        self.root = Path(root).resolve()
        self._db_url = db_url
        self._storage_options = storage_options  # for a run on object storage (s3://)
        self._followers: weakref.WeakSet[Follower] = weakref.WeakSet()
        self._pins: weakref.WeakSet[Pin] = weakref.WeakSet()
        self._side: Ledger | None = None  # opened at the first pin or evaluation
        self._db = open_ledger(ledger_url(self.root, db_url, readonly=True), readonly=True)
        self._closed = False
        try:
            run = open_as_reader(self._db, self.root, adopt_single=db_url is None)
        except BaseException:
            self.close()
            raise
        self.run_id, self.run_name, self.save_dir = run.run_id, run.name, run.save_dir
        self.run_created_at = run.created_at
        self.policies: dict[str, Policy] = run.policies
        self._queries = RunQueries(self._db, self.run_id, self.save_dir, self.policies)

    def __enter__(self) -> RunReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for follower in list(self._followers):
                follower.close()
            failures: list[BaseException] = []
            for pin in list(self._pins):
                try:
                    pin.release()
                except Exception as exc:  # the others are released all the same
                    failures.append(exc)
            if self._side is not None:
                self._side.dispose()
            self._db.dispose()
            if failures:
                for other in failures[1:]:
                    note_on(failures[0], f"releasing another pin failed too: {other!r}")
                raise failures[0]

    def _open(self) -> RunQueries:
        if self._closed:
            raise LedgerError(f"the reader of {self.root} is closed")
        return self._queries

    def latest(self, stream: str = "model") -> Checkpoint | None:
        """The newest committed checkpoint of ``stream`` (by publication, not by mtime)."""
        return self._open().latest(stream)

    def best(self, stream: str = "best") -> list[Checkpoint]:
        """The members of a top-K stream, best first."""
        return self._open().best(stream)

    def checkpoints(
        self, stream: str | None = None, *, states: Iterable[str] = (m.COMMITTED,)
    ) -> list[Checkpoint]:
        """Checkpoints (committed ones unless ``states`` says otherwise), by stream then step."""
        return self._open().checkpoints(stream, states=states)

    def resolve(
        self,
        which: str | int | Checkpoint | os.PathLike[str] = "latest",
        *,
        stream: str | None = None,
    ) -> Checkpoint:
        """The committed checkpoint ``which`` names (see :func:`ckptdb.resolve`).

        A run root (this one's or another's) names that run's latest; a
        checkpoint (or path) outside this run's save directory resolves
        through the ledger of the run that holds it; everything else in this
        run's ledger.
        """
        return self._resolve(which, stream)[0]

    def _resolve(self, which: object, stream: str | None) -> tuple[Checkpoint, Path]:
        """The checkpoint, and the save directory of the run that holds it."""
        queries = self._open()
        which = _step_or_spec(which)
        if _names_an_object(which):
            # an object has no run root above it and no local file: the ledger decides
            if relative_within(_object_location(which), self.save_dir) is None:
                raise CheckpointNotFoundError(
                    f"{_object_location(which)} is not in this run's save directory "
                    f"{self.save_dir}: open a RunReader on the run that saved it"
                )
            return queries.resolve(which, stream, self.root), self.save_dir
        if isinstance(which, (str, os.PathLike, Checkpoint)) and which not in ("latest", "best"):
            path = which.path if isinstance(which, Checkpoint) else Path(which).expanduser()
            run = _run_root(path, self._db_url)
            if run is not None and run[0] != self.root:
                return _resolve(path, None, self._db_url, stream)
            if run is not None:
                return _latest_of(self, stream), self.save_dir
            if not _inside(path, self.save_dir):
                return _resolve(path, None, self._db_url, stream)
        return queries.resolve(which, stream, self.root), self.save_dir

    def load(
        self,
        which: str | int | Checkpoint | os.PathLike[str] | Pin = "latest",
        *,
        stream: str | None = None,
        map_location: Any = "cpu",
        weights_only: bool = True,
        into: dict[str, Any] | None = None,
        missing_keys: Literal["error", "keep"] = "error",
    ) -> Any:
        """Load a committed checkpoint after verifying its size and hash, as the manager does.

        ``which`` is anything :meth:`resolve` takes. A payload that does not
        match its row raises :class:`~ckptdb.errors.CorruptCheckpointError`
        (a vanished one :class:`~ckptdb.errors.CheckpointLostError`) before
        anything is unpickled. A reader never writes to the ledger: the row
        is marked by the run's writer, at its next ``load`` of that checkpoint
        or ``reconcile(verify=True)`` (``ckptdb reconcile --verify``), and
        ``ckptdb check`` reports it meanwhile. A :class:`~ckptdb.pinning.Pin`
        loads the checkpoint it holds, even after retention evicted it.
        ``missing_keys`` is the manager's (a sharded checkpoint saved on several
        ranks, loaded here in one process).
        """
        from .storage import topology  # torch: a load imports it, a query never does

        topology.check_policy(missing_keys)
        if isinstance(which, Pin):
            if which.released:
                raise InvalidArgumentError(f"{which!r} is released: its file may be gone")
            target, save_dir = which.checkpoint, self.save_dir
        else:
            target, save_dir = self._resolve(which, stream)
        return load_verified(
            target,
            save_dir,
            map_location=map_location,
            weights_only=weights_only,
            into=into,
            storage_options=self._storage_options,
            missing_keys=missing_keys,
        )

    def follow(
        self,
        stream: str = "model",
        *,
        since: int | None = None,
        timeout: float | None = None,
        poll: float = POLL_INTERVAL,
    ) -> Follower:
        """Each checkpoint of ``stream`` published from now on, in commit order, once.

        ``since`` is a cursor, a checkpoint id: only checkpoints after it are
        yielded (``since=0``: the stream's whole history; None: from this
        call on, including a boundary already in flight). Pass the last id
        you handled to continue after a restart without missing or repeating
        any. A checkpoint evicted (or found lost or corrupt) before the
        follower got to it is still yielded, its ``state`` saying so
        (``deleting``, ``deleted``, ...): check ``checkpoint.state ==
        "committed"`` before loading it.

        On PostgreSQL (psycopg 3) the writer's commit wakes the follower
        (``LISTEN/NOTIFY``); on SQLite it polls every ``poll`` seconds with
        one query. ``timeout``: stop after that many seconds without a new
        checkpoint (None: until the caller stops). The cursor and the stream
        are settled by this call; the returned iterator holds a connection
        until it is closed (``with reader.follow(...) as f:``) or the reader is.
        """
        self._open().policy(stream)
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not poll > 0:
            raise InvalidArgumentError(f"poll must be a positive number of seconds, got {poll!r}")
        if since is not None and (isinstance(since, bool) or not isinstance(since, int)):
            raise ArgumentTypeError(f"since must be a checkpoint id (an int), got {since!r}")
        follower = Follower(
            self._db,
            self.run_id,
            stream,
            self.save_dir,
            since,
            timeout,
            float(poll),
            lambda: not self._closed,
        )
        self._followers.add(follower)
        return follower

    # ------------------------------------------------- the reader's own rows

    def _writable(self) -> Ledger:
        """The connection for the reader's own rows (pins, evaluations); never the
        read-only one, which the server (or SQLite) keeps from writing."""
        self._open()
        if self._side is None:
            url = ledger_url(self.root, self._db_url, readonly=False)
            # writing SQLite from another host over NFS corrupts it: refused as for writers
            check_ledger_location(url)
            self._side = open_ledger(url)
        return self._side

    def replicas(self, tier: str | None = None) -> list[Replica]:
        """Every copy of the run's checkpoints on other tiers (of ``tier``), oldest first:
        what :class:`~ckptdb.replication.Replicator` recorded."""
        self._open()
        with self._db.transaction(read=True) as session:
            found = replicas.of_run(session, self.run_id, tier)
            return [replicas.to_record(session, row) for row in found]

    def tiers(self) -> list[tiers.Registration]:
        """The run's registered tiers: where copies go, which streams, and each stream's
        retention there (what the newest :class:`~ckptdb.replication.Replicator` said)."""
        self._open()
        with self._db.transaction(read=True) as session:
            return tiers.registrations(session, self.run_id)

    def waiting_for_copy(self) -> list[tuple[Checkpoint, str]]:
        """Evicted checkpoints whose local files stay until their copy is whole, with the
        tier each waits for."""
        queries = self._open()
        with self._db.transaction(read=True) as session:
            found = tiers.waiting(session, self.run_id)
            return [(rows.to_record(row, queries.save_dir), tier) for row, tier in found]

    def pin(
        self,
        which: str | int | Checkpoint | os.PathLike[str] = "latest",
        *,
        stream: str | None = None,
        ttl: float = 600.0,
        holder: str | None = None,
    ) -> Pin:
        """Keep a committed checkpoint's file on disk while you use it: a lease.

        ``with reader.pin(ckpt, ttl=600):`` pins it (``which`` as for
        :meth:`resolve`, in this run); retention may evict it meanwhile, but
        its file stays (its row ``deleting``) until the last pin is released
        or has expired. The lease is renewed every ``ttl / 3`` seconds while
        held, so a reader that crashes pins for at most ``ttl``. A checkpoint
        already evicted (or lost, corrupt) cannot be pinned:
        :class:`~ckptdb.errors.CheckpointNotFoundError`.
        """
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < 10**7:
            raise InvalidArgumentError(f"ttl must be a positive number of seconds, got {ttl!r}")
        if holder is not None and not isinstance(holder, str):
            raise ArgumentTypeError(f"holder must be a str, got {holder!r}")
        target = self._open().resolve(_step_or_spec(which), stream, self.root)
        side = self._writable()
        who = f"{socket.gethostname()}:{os.getpid()}" + (f" {holder}" if holder else "")
        with side.transaction() as session:
            pin_id, expires = pins.add(session, self.run_id, target.id, who, float(ttl))

        def renew(ident: int, seconds: float) -> dt.datetime | None:
            with side.transaction(durable=False) as session:
                return pins.renew(session, ident, seconds)

        def release(ident: int) -> None:
            with side.transaction(durable=False) as session:
                pins.release(session, ident)

        pin = Pin(target, pin_id, expires, float(ttl), renew, release)
        self._pins.add(pin)
        return pin

    def pins(self) -> list[tuple[m.Pin, Checkpoint]]:
        """The run's pins (live, released or expired but not yet cleared), oldest first."""
        queries = self._open()
        with self._db.transaction(read=True) as session:
            found = pins.listing(session, self.run_id)
            return [(pin, rows.to_record(row, queries.save_dir)) for pin, row in found]

    def record_evaluation(
        self,
        checkpoint: Checkpoint | int,
        values: Mapping[str, float],
        *,
        evaluator: str,
    ) -> None:
        """Store values an evaluator computed for ``checkpoint`` (a Checkpoint or its id).

        One row per value in the ``evaluations`` table (view
        ``checkpoint_evaluations``); recording a name again for the same
        checkpoint and evaluator replaces it. Several evaluators may score
        one checkpoint. NaN is stored as NULL and never ranks.
        """
        ident = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
        if isinstance(ident, bool) or not isinstance(ident, int):
            raise ArgumentTypeError(f"checkpoint must be a Checkpoint or an id, got {checkpoint!r}")
        if not isinstance(evaluator, str) or not evaluator or len(evaluator) > 255:
            raise InvalidArgumentError(f"evaluator must be a name (1-255 chars), got {evaluator!r}")
        checked = evaluations.checked_values(values)
        with self._writable().transaction() as session:
            evaluations.record(session, self.run_id, ident, evaluator, checked)

    def evaluations(self, checkpoint: Checkpoint | int) -> dict[str, dict[str, float | None]]:
        """What was recorded for ``checkpoint``: evaluator -> name -> value (NaN as None)."""
        ident = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
        self._open()
        found: dict[str, dict[str, float | None]] = {}
        with self._db.transaction(read=True) as session:
            for row in evaluations.of_checkpoint(session, ident):
                found.setdefault(row.evaluator, {})[row.name] = row.value
        return found

    def last_evaluated(self, evaluator: str, stream: str = "model") -> int | None:
        """The id of the newest checkpoint of ``stream`` that ``evaluator`` recorded
        anything for (None if none): where a restarted ``ckptdb follow`` continues."""
        self._open()
        with self._db.transaction(read=True) as session:
            return evaluations.last_evaluated_id(session, self.run_id, evaluator, stream)

    def best_by(
        self,
        name: str,
        *,
        mode: Literal["min", "max"] = "max",
        evaluator: str | None = None,
        stream: str | None = None,
    ) -> list[tuple[Checkpoint, float, str]]:
        """Committed checkpoints ranked by an evaluated value, best first:
        (checkpoint, value, evaluator). Ties go to the earlier step."""
        if mode not in ("min", "max"):
            raise InvalidArgumentError(f"mode must be 'min' or 'max', got {mode!r}")
        queries = self._open()
        if stream is not None:
            queries.policy(stream)
        with self._db.transaction(read=True) as session:
            found = evaluations.best(
                session, self.run_id, name, mode, evaluator=evaluator, stream=stream
            )
            return [(rows.to_record(row, queries.save_dir), v, who) for row, v, who in found]

    def check(self) -> list[str]:
        """Violations of the run's consistency invariants, one line each (empty: consistent).

        What :meth:`ckptdb.CheckpointManager.check` finds without ``load``: each
        committed file's size and hash against its row, the disk against the
        ledger, the latest pointers and retention, every recorded export's files
        (see :mod:`ckptdb.protocol.check`). It writes nothing to the ledger or the
        checkpoints, and holds the run's writer lock (its lock file) while it
        looks, so that a trainer's checkpoint in flight is never reported: while
        one runs it raises :class:`~ckptdb.errors.LedgerLockedError`, naming it.
        """
        from .exports.checking import check_exports
        from .ledger.lock import writer_lock
        from .protocol.check import Checker
        from .storage.naming import run_token
        from .storage.opening import open_store

        self._open()
        lock = writer_lock(self.root, ledger_url(self.root, self._db_url, readonly=False))
        lock.acquire()
        try:
            store = open_store(self.save_dir, self._storage_options, probe=False)
            if not store.renames:  # an object store names the run's objects with its token
                assert self.run_created_at is not None
                store.run_token = run_token(self.run_name, self.run_id, self.run_created_at)
            found = Checker(self._db, self.run_id, self.root, store, self.policies).run()
            return found + check_exports(self._db, self.run_id)
        finally:
            lock.release()

    def export(
        self,
        which: str | int | Checkpoint | os.PathLike[str] = "latest",
        *,
        to: str | os.PathLike[str],
        stream: str | None = None,
        format: str = "safetensors",
        key: str | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        trust_pickle: bool = False,
    ) -> ExportResult:
        """Write a committed checkpoint as Hugging Face safetensors into ``to``, and record it.

        ``which`` is anything :meth:`resolve` takes, in this run. ``to`` must be
        absent or an empty directory outside the run's save directory
        (:class:`~ckptdb.errors.ExportTargetError` otherwise). The checkpoint is
        verified against its row first (:class:`~ckptdb.errors.CorruptCheckpointError`,
        :class:`~ckptdb.errors.CheckpointLostError`). It may be a state dict saved
        with ``torch.save`` (``key`` picks one entry of it, such as ``"model"``), a
        Lightning ``.ckpt``, an HF Trainer ``checkpoint-N/`` (its config and
        tokenizer files are copied, so ``from_pretrained(to)`` loads it) or a
        sharded DCP checkpoint saved on any number of ranks, consolidated one
        tensor at a time. Weights above ``max_shard_size`` (bytes, or ``"5GB"``)
        are split into ``model-0000k-of-0000n.safetensors`` with an index.
        ``trust_pickle``: unpickle a file that holds more than tensors and plain
        values (only for files you trust).

        The export is recorded (table ``exports``) once complete and in place. A
        crash while it is written leaves only a hidden temporary beside ``to``
        (the next export there removes it); one between the rename and the
        record leaves a complete directory without a row. See
        :mod:`ckptdb.exports` and docs/export.md.
        """
        options = ExportOptions.of(to, format, key, max_shard_size, trust_pickle)
        target, save_dir = self._resolve(which, stream)
        if save_dir != self.save_dir:
            raise CheckpointNotFoundError(
                f"{target.path} belongs to another run: open a RunReader on the run that saved it"
            )
        check_export_target(options.to, save_dir)
        store, rel = open_verified_payload(
            save_dir, target.path, target.size, target.hash, self._storage_options
        )

        def record(written: Written) -> Export:
            with self._writable().transaction() as session:
                ident = ledger_exports.record(
                    session,
                    self.run_id,
                    target.id,
                    options.format,
                    written.path,
                    written.files,
                    written.size,
                    written.hash,
                    written.tensors,
                )
                found = ledger_exports.of_run(session, self.run_id, target.id)
                return next(e for e in found if e.id == ident)

        try:
            return export_payload(store, rel, options, record)
        finally:
            store.forget_verified()

    def exports(self, checkpoint: Checkpoint | int | None = None) -> list[Export]:
        """The run's recorded exports (of one checkpoint, or its id), oldest first."""
        ident = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
        if ident is not None and (isinstance(ident, bool) or not isinstance(ident, int)):
            raise ArgumentTypeError(f"checkpoint must be a Checkpoint or an id, got {checkpoint!r}")
        self._open()
        with self._db.transaction(read=True) as session:
            return ledger_exports.of_run(session, self.run_id, ident)

    def state_counts(self) -> dict[str, int]:
        return self._open().state_counts()

    def committed_counts(self) -> dict[str, int]:
        """Committed checkpoints per stream (a stream without any is absent)."""
        return self._open().committed_counts()

    def goodput(self) -> GoodputReport:
        """Where the run's wall-clock time went, over all its attempts: productive,
        saving, lost (redone), restart and idle seconds, per attempt and in total,
        and the checkpoint interval ``interval="auto"`` would choose next (see
        :mod:`ckptdb.goodput` and docs/goodput.md)."""
        queries = self._open()
        return goodput.report(queries.db, self.run_id, self.run_name)

    def attempts(self) -> list[m.Attempt]:
        return self._open().attempts()

    def events(self, limit: int = 10) -> list[m.Event]:
        """The newest ``limit`` events, oldest first."""
        return self._open().events(limit)

    def events_of(self, *kinds: str) -> list[m.Event]:
        """Every event of these kinds (``preempted``, ``resumed``...), oldest first."""
        return self._open().events_of(*kinds)

    def preemptions(self) -> list[dict[str, Any]]:
        """One entry per preempted attempt: the step the ranks agreed to stop at, the
        signal and the ranks that received it, whether its checkpoint was saved, the
        step training resumes from (the next attempt's resume, else the saved step)
        and how many steps that cost."""
        return preemption_summary(self.events_of("preempted", "preemption_saved", "resumed"))

    def metric_history(self, name: str) -> list[tuple[int, float, int]]:
        """(step, value, attempt id) of one metric, by step then attempt."""
        return self._open().metric_history(name)

    def metric_names(self) -> list[str]:
        return self._open().metric_names()

    def sql(self, statement: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only SQL statement; a statement that would write is refused."""
        self._open()
        return run_sql(self._db, statement)


def resolve(
    spec: str | int | Checkpoint | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    db_url: str | None = None,
    stream: str | None = None,
) -> Checkpoint:
    """Restart resolution: the committed checkpoint a ``--resume``/``--init-from`` names.

    ``spec`` may be:

    - ``"latest"``, ``"best"`` or a step (an int, or a string of digits that
      is not an existing path): in the run at ``root`` (of ``stream``;
      ``"latest"`` and steps default to ``model``, ``"best"`` to ``best``);
    - a :class:`Checkpoint`, or the path of a checkpoint: in the run that
      holds it, found from the path (a run root above it, its ledger there
      or in ``db_url``, or a Lightning-style ``.<dirpath>.ckptdb`` ledger
      beside a directory), else ``root``;
    - the root of a run: that run's latest (of ``stream``; else ``model``;
      else its newest committed checkpoint).

    Every answer comes from the ledger of the run that owns it, never from
    another run's ledger and never from file names or mtimes. Raises
    :class:`~ckptdb.errors.CheckpointNotFoundError` when nothing committed
    matches.
    """
    return _resolve(spec, root, db_url, stream)[0]


def _resolve(
    spec: object, root: str | os.PathLike[str] | None, db_url: str | None, stream: str | None
) -> tuple[Checkpoint, Path]:
    spec = _step_or_spec(spec)
    if isinstance(spec, bool) or not isinstance(spec, (str, int, Checkpoint, os.PathLike)):
        raise ArgumentTypeError(
            f"spec must be 'latest', 'best', a step, a Checkpoint or a path; got {spec!r}"
        )
    if isinstance(spec, int) or spec in ("latest", "best"):
        if root is None:
            raise InvalidArgumentError(f"resolve({spec!r}) needs root=, the run to look in")
        with RunReader(root, db_url=db_url) as reader:
            return reader._open().resolve(spec, stream, reader.root), reader.save_dir
    if _names_an_object(spec):
        if root is None:
            raise InvalidArgumentError(
                f"resolve({str(_object_location(spec))!r}) needs root=: an object in object "
                "storage has no run directory above it"
            )
        with RunReader(root, db_url=db_url) as reader:
            return reader._resolve(spec, stream)
    path = spec.path if isinstance(spec, Checkpoint) else Path(spec).expanduser()
    run = _run_root(path, db_url)
    if run is not None:
        with RunReader(run[0], db_url=run[1]) as reader:
            return _latest_of(reader, stream), reader.save_dir
    owner, url = _owner_of(path, root, db_url)
    with RunReader(owner, db_url=url) as reader:
        return reader._open().resolve(path, stream, reader.root), reader.save_dir


def _names_an_object(spec: object) -> bool:
    """Whether ``spec`` is an ``s3://`` URL, or a record or path of an object: resolved
    through a ledger only (``Path`` would fold the URL, and there is no local file)."""
    return is_object_url(_object_location(spec))


def _object_location(spec: object) -> object:
    return spec.path if isinstance(spec, Checkpoint) else spec


def _step_or_spec(spec: object) -> object:
    """A string of digits that names no existing path is a step (from a command line)."""
    if isinstance(spec, str) and spec.isdigit() and not os.path.lexists(spec):
        return int(spec)
    return spec


def load_verified(
    target: Checkpoint,
    save_dir: Path,
    *,
    map_location: Any,
    weights_only: bool,
    into: dict[str, Any] | None,
    storage_options: Mapping[str, object] | None = None,
    missing_keys: str = "error",
) -> Any:
    """Read a committed checkpoint after checking it against its row, through its run's
    store (confined to the save directory, links refused); never writes the ledger."""
    from .storage import topology
    from .storage.kinds import kind_of_path

    store, rel = open_verified_payload(
        save_dir, target.path, target.size, target.hash, storage_options
    )
    kind = kind_of_path(rel)
    kind.check_into(str(target.path), into)
    try:
        return kind.load(
            store,
            rel,
            map_location=map_location,
            weights_only=weights_only,
            into=into,
            group=None,
            planner=topology.LayoutCheckingPlanner(
                missing_keys,
                where=str(target.path),
                saved_world_size=target.world_size,
                world_size=1,
            ),
        )
    except FileNotFoundError as exc:  # evicted between the check and the read
        raise CheckpointLostError(f"{target.path} was removed while it was being loaded") from exc


def _latest_of(reader: RunReader, stream: str | None) -> Checkpoint:
    """A run's latest: of ``stream``, else of ``model``, else its newest committed one."""
    if stream is not None or "model" in reader.policies:
        return reader._open().resolve("latest", stream, reader.root)
    found = reader.checkpoints()
    if not found:
        raise CheckpointNotFoundError(f"run {reader.root} has no committed checkpoint yet")
    return max(found, key=lambda c: (c.committed_at, c.id))


def _inside(path: Path, directory: Path) -> bool:
    absolute = Path(os.path.abspath(path))
    return absolute.is_relative_to(Path(os.path.abspath(directory))) or (
        Path.cwd() / path
    ).resolve().is_relative_to(directory.resolve())


def _run_root(path: Path, db_url: str | None) -> tuple[Path, str | None] | None:
    """(root, db_url) of the run whose root ``path`` is: its SQLite ledger there (or,
    for a Lightning dirpath, beside it), or a run registered in ``db_url``."""
    if not path.is_dir():
        return None
    absolute = Path(os.path.abspath(path))
    if (absolute / LEDGER_FILE).is_file():
        return absolute.resolve(), None
    beside = ledger_beside(absolute)
    if (beside / LEDGER_FILE).is_file():
        return beside.resolve(), None
    if db_url is not None:
        resolved = absolute.resolve()
        if run_exists(resolved, ledger_url(resolved, db_url, readonly=True)):
            return resolved, db_url
    return None


def _owner_of(
    path: Path, root: str | os.PathLike[str] | None, db_url: str | None
) -> tuple[Path, str | None]:
    """(root, db_url) of the run that holds the checkpoint at ``path``: the first
    run root among its ancestors, as written (a symlinked directory is the
    run's own path) and then resolved; else ``root``."""
    absolute = Path(os.path.abspath(path))
    for ancestor in [*absolute.parents, *absolute.resolve().parents]:
        found = _run_root(ancestor, db_url)
        if found is not None:
            return found
    if root is not None:
        return Path(root).resolve(), db_url
    raise CheckpointNotFoundError(
        f"{path} is in no ckptdb run (no ledger above it); pass root= to name the run"
    )


def preemption_summary(events: Iterable[Any]) -> list[dict[str, Any]]:
    """Per ``preempted`` event (oldest first, with the ``preemption_saved`` and
    ``resumed`` events of the run): what the preemption cost.

    ``resumed_from`` is the step the next attempt resumed from (its ``resumed``
    event), else the preemption checkpoint's step when it was saved, else None
    (nothing known yet); ``lost`` is the agreed step minus that.
    """
    events = list(events)
    summary = []
    for told in (e for e in events if e.kind == "preempted"):
        detail = json.loads(told.detail or "{}")
        saved = [
            json.loads(e.detail or "{}")
            for e in events
            if e.kind == "preemption_saved" and e.attempt_id == told.attempt_id
        ]
        later = [
            e.step
            for e in events
            if e.kind == "resumed" and (e.attempt_id or 0) > (told.attempt_id or 0)
        ]
        was_saved = bool(saved and saved[-1].get("saved"))
        resumed_from = later[0] if later else (told.step if was_saved else None)
        summary.append(
            {
                "attempt": told.attempt_id,
                "step": told.step,
                "signal": detail.get("signal"),
                "ranks": detail.get("ranks"),
                "saved": was_saved if saved else None,
                "why": saved[-1].get("why") if saved and not was_saved else None,
                "resumed_from": resumed_from,
                "lost": told.step - resumed_from if resumed_from is not None else None,
            }
        )
    return summary
