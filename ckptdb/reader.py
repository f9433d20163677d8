"""Read-only access to a run: for the CLI, notebooks and dashboards.

A reader takes no writer lock, starts no attempt and never reconciles, so it
works while a trainer holds the run. It changes nothing the trainer owns; the
only rows it writes are its own, each in a short transaction on a connection
of its own: pins (leases that keep a checkpoint's file on disk while it is
read), evaluations (values computed for a checkpoint) and exports (a
checkpoint written as safetensors outside the run). SQLite ledgers are opened with
``mode=ro`` and ``PRAGMA query_only`` (a write is refused by SQLite itself, not
by inspecting the statement), each query runs in one snapshot transaction,
and only committed data is visible (WAL readers never see a transaction in
progress). PostgreSQL readers run every transaction as ``REPEATABLE READ,
READ ONLY``: one snapshot of committed data, and the server refuses writes.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import weakref
from collections.abc import Callable, Iterable, Mapping
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
from .ledger.tiers import Registration
from .location import is_object_url, relative_within
from .pinning import Pin
from .policies import Policy
from .record import Checkpoint, Export, Replica
from .statusout import PREEMPTION_EVENTS, preemption_summary
from .storage.opening import open_verified_payload

__all__ = ["RunReader", "ledger_url", "resolve", "run_exists"]

#: How often a follower of a SQLite ledger looks for new checkpoints (seconds).
POLL_INTERVAL = 0.5


class RunReader:
    """Queries one run's ledger without taking its writer lock.

    A reader takes no lock, starts no attempt and never reconciles, so an
    evaluator, an exporter, a dashboard or a notebook can use it while a
    trainer holds the run. It sees committed data only, each query in one
    snapshot, and changes nothing the trainer owns: the only rows it writes
    are its own pins, evaluations and exports, each in a short transaction
    on a connection of its own. Reading imports neither torch nor Alembic;
    only :meth:`load` and :meth:`export` import torch. Use it as a context
    manager (``with RunReader(root) as reader:``), or call :meth:`close`.

    A reader needs the ledger at this ckptdb's schema, since it never
    migrates.

    Args:
        root: The run's root directory (the one a
            :class:`~ckptdb.CheckpointManager` was opened on); resolved to an
            absolute path.
        db_url: The ledger's URL when it is not the run's own SQLite file,
            e.g. a PostgreSQL ledger (``postgresql+psycopg://...``). None
            (the default): ``<root>/ckptdb.sqlite``, which belongs to its run
            even after the directory was moved or renamed.
        storage_options: Options of the object store that holds the run's
            checkpoints, for a run saved to ``s3://`` (see docs/s3.md); None
            (the default) for none. A local save directory is read without
            them.

    Attributes:
        root: The run's root, absolute.
        run_id: The run's id in the ledger.
        run_name: The run's name.
        save_dir: Where the run's checkpoints are (a path, or an object-store
            location).
        run_created_at: When the run was created.
        policies: Each stream's stored retention policy, by stream name.

    Raises:
        LedgerError: When ``root`` holds no ckptdb run (no ledger there, or
            the ledger has no run rooted there), or the ledger cannot be
            opened (a bad URL, a missing driver).
        SchemaVersionError: When the ledger is at an older schema (run
            ``ckptdb db upgrade ROOT``) or a newer one.
        DatabaseError: When the database cannot be reached.
    """

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
        """Release what the reader holds: its followers, its pins and its connections.

        Every pin it made is released (so retention may remove the files they
        kept) and every follower stops. Closing twice does nothing; any other
        call on a closed reader raises :class:`~ckptdb.errors.LedgerError`.
        Leaving the ``with`` block calls it.

        Raises:
            Exception: What releasing a pin raised (the ledger unreachable,
                say), after every other pin is released and the connections
                closed; further failures are noted on it.
        """
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
        """The newest committed checkpoint of a stream.

        Newest by publication in the ledger, never by file name or mtime, so
        a checkpoint copied or touched later does not take its place.

        Args:
            stream: The stream's name (default ``"model"``).

        Returns:
            The checkpoint, or None when the stream has nothing committed.

        Raises:
            UnknownStreamError: When the run has no such stream.
            LedgerError: When the reader is closed.
        """
        return self._open().latest(stream)

    def best(self, stream: str = "best") -> list[Checkpoint]:
        """The members of a top-K stream, best first.

        Ranked by the stream's metric as its :class:`~ckptdb.TopK` policy
        ranks them; ties go to the earlier step.

        Args:
            stream: The name of a stream with a :class:`~ckptdb.TopK` policy
                (default ``"best"``).

        Returns:
            Its committed checkpoints, best first; empty when none.

        Raises:
            UnknownStreamError: When the run has no such stream.
            InvalidArgumentError: When the stream is not a top-K stream.
            LedgerError: When the reader is closed.
        """
        return self._open().best(stream)

    def checkpoints(
        self, stream: str | None = None, *, states: Iterable[str] = (m.COMMITTED,)
    ) -> list[Checkpoint]:
        """The run's checkpoints, committed ones unless ``states`` says otherwise.

        Args:
            stream: Only this stream's; None (the default) for every stream.
            states: The row states to list (default: ``committed`` only).
                Others are ``pending``, ``deleting``, ``deleted``, ``aborted``,
                ``lost`` and ``corrupt``.

        Returns:
            The checkpoints, by stream then step.

        Raises:
            UnknownStreamError: When ``stream`` is not a stream of the run.
            LedgerError: When the reader is closed.
        """
        return self._open().checkpoints(stream, states=states)

    def resolve(
        self,
        which: str | int | Checkpoint | os.PathLike[str] = "latest",
        *,
        stream: str | None = None,
    ) -> Checkpoint:
        """The committed checkpoint ``which`` names.

        Resolution follows :func:`ckptdb.resolve`: a run root (this one's or
        another's) names that run's latest; a checkpoint (or path) outside
        this run's save directory resolves through the ledger of the run that
        holds it; everything else in this run's ledger. The answer always
        comes from a ledger, never from file names or mtimes.

        Args:
            which: ``"latest"`` (the default), ``"best"``, a step (an int, or
                a string of digits that names no existing path), a
                :class:`~ckptdb.Checkpoint`, the path of a checkpoint or the
                root of a run.
            stream: The stream to look in: None (the default) means
                ``model`` for ``"latest"`` and steps, ``best`` for
                ``"best"``, and for a run root ``model`` if the run has it,
                else its newest committed checkpoint of any stream.

        Returns:
            The committed checkpoint.

        Raises:
            CheckpointNotFoundError: When nothing committed matches (an empty
                stream, a step or path without a committed checkpoint, an
                object outside this run's save directory).
            UnknownStreamError: When ``stream`` is not a stream of the run.
            InvalidArgumentError: When a step is outside 0 to ``2**63 - 1``.
            ArgumentTypeError: When ``which`` is none of the above.
            LedgerError: When the reader is closed.
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

        A payload that does not match its row is refused before anything is
        unpickled, so a damaged file never reaches your process. A reader
        never writes a checkpoint's row: the run's writer marks it, at its
        next ``load`` of that checkpoint or ``reconcile(verify=True)``
        (``ckptdb reconcile --verify``), and ``ckptdb check`` reports it
        meanwhile. A sharded checkpoint saved on any number of ranks loads
        whole into ``into`` in this one process. To keep retention from
        removing the file while you load, pin it first and load the pin
        (``with reader.pin(ckpt) as pin: reader.load(pin)``).

        Args:
            which: Anything :meth:`resolve` takes (default ``"latest"``), or a
                :class:`~ckptdb.pinning.Pin`: the checkpoint it holds, even
                after retention evicted it.
            stream: The stream to resolve ``which`` in, as for :meth:`resolve`.
            map_location: Passed to ``torch.load`` (default ``"cpu"``).
            weights_only: Passed to ``torch.load`` (default True: only
                tensors and plain values are unpickled). Pass False only for
                files you trust.
            into: For a sharded checkpoint, the state dict to load into, in
                place (required there); None (the default) for a file, which
                refuses one.
            missing_keys: What a key of ``into`` that the sharded checkpoint
                lacks does: ``"error"`` (the default) raises
                :class:`~ckptdb.errors.LayoutMismatchError`; ``"keep"`` leaves
                those values as they are in ``into``.

        Returns:
            What ``torch.load`` returned for a file checkpoint; ``into``,
            filled in place, for a sharded one.

        Raises:
            CorruptCheckpointError: When the file's size or hash differs from
                its row.
            CheckpointLostError: When the file is gone (or removed while it
                was being loaded).
            CheckpointNotFoundError: When nothing committed matches ``which``.
            LayoutMismatchError: When a sharded load asks for a key the
                checkpoint lacks (unless ``missing_keys="keep"``) or a tensor of
                another global shape.
            InvalidArgumentError: When the pin is released, ``missing_keys``
                is neither ``"error"`` nor ``"keep"``, ``into`` does not fit the
                checkpoint's kind, or the checkpoint is a directory a
                framework wrote (load it with that framework from
                ``checkpoint.path``).
            UnknownStreamError: When ``stream`` is not a stream of the run.
            LedgerError: When the reader is closed.
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
        stop: Callable[[], bool] | None = None,
    ) -> Follower:
        """Each checkpoint of a stream published after a cursor, in commit order, once.

        For a sidecar evaluator or exporter: pass the id of the last
        checkpoint you handled as ``since`` to continue after a restart
        without missing or repeating any. A checkpoint evicted (or found lost
        or corrupt) before the follower got to it is still yielded, its
        ``state`` saying so (``deleting``, ``deleted``, ...): check
        ``checkpoint.state == "committed"`` before loading it, or pin it.

        On PostgreSQL (psycopg 3) the writer's commit wakes the follower
        (``LISTEN/NOTIFY``, sent in the commit transaction); on SQLite it
        polls every ``poll`` seconds with one indexed query. The cursor and
        the stream are settled by this call, not at the first ``next()``, so
        a checkpoint committed after the call is seen. The returned iterator
        holds a connection until it is closed (``with reader.follow(...) as
        f:``) or the reader is.

        Args:
            stream: The stream to follow (default ``"model"``).
            since: A cursor, a checkpoint id: only checkpoints after it are
                yielded. ``0``: the stream's whole history; None (the
                default): those published after this call, including a
                boundary already in flight.
            timeout: Stop (end the iteration) after one ``next()`` has
                waited that many seconds without a new checkpoint (the time
                the caller spends on each checkpoint does not count); None
                (the default): until the caller stops.
            poll: Seconds between two queries on SQLite (default 0.5); must
                be positive.
            stop: Asked at each ``next()`` and after each wait (at most
                ``poll`` seconds apart): True ends the iteration as a timeout
                does. A signal handler or another thread ends a follow this
                way without raising into it (``stop=event.is_set``).

        Returns:
            An iterator of :class:`~ckptdb.Checkpoint` (and a context
            manager); its ``cursor`` is the id it has read up to.

        Raises:
            UnknownStreamError: When the run has no such stream.
            InvalidArgumentError: When ``poll`` is not a positive number.
            ArgumentTypeError: When ``since`` is not an int or ``stop`` is not
                callable.
            DatabaseError: When the follower cannot listen on a PostgreSQL
                ledger.
            LedgerError: When the reader is closed (also from the iterator,
                once the reader or the follower is closed).
        """
        self._open().policy(stream)
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not poll > 0:
            raise InvalidArgumentError(f"poll must be a positive number of seconds, got {poll!r}")
        if since is not None and (isinstance(since, bool) or not isinstance(since, int)):
            raise ArgumentTypeError(f"since must be a checkpoint id (an int), got {since!r}")
        if stop is not None and not callable(stop):
            raise ArgumentTypeError(f"stop must be a callable returning a bool, got {stop!r}")
        follower = Follower(
            self._db,
            self.run_id,
            stream,
            self.save_dir,
            since,
            timeout,
            float(poll),
            lambda: not self._closed,
            stop,
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
        """Every copy of the run's checkpoints on other tiers, as the replicator recorded them.

        A :class:`~ckptdb.replication.Replicator` copies committed checkpoints
        to object storage and records each copy and its state (``uploading``,
        ``replicated``, ``failed``, ``deleting``, ``deleted``).

        Args:
            tier: Only this tier's copies (``"remote"`` is the replicator's);
                None (the default) for every tier.

        Returns:
            The copies, oldest first.

        Raises:
            LedgerError: When the reader is closed.
        """
        self._open()
        with self._db.transaction(read=True) as session:
            found = replicas.of_run(session, self.run_id, tier)
            return [replicas.to_record(session, row) for row in found]

    def tiers(self) -> list[Registration]:
        """The run's registered tiers: where copies go, which streams, and their retention.

        A :class:`~ckptdb.replication.Replicator` registers its tier when it
        opens; from then on local retention keeps an evicted checkpoint of a
        copied stream until its copy is whole. What is listed is what the
        newest replicator said.

        Returns:
            One registration per tier, by tier name: ``tier``, ``location``,
            ``streams`` (None: every stream), ``policies`` (each stream's
            retention there) and ``registered_at``.

        Raises:
            LedgerError: When the reader is closed.
        """
        self._open()
        with self._db.transaction(read=True) as session:
            return tiers.registrations(session, self.run_id)

    def waiting_for_copy(self) -> list[tuple[Checkpoint, str]]:
        """Evicted checkpoints whose local files stay until their copy is whole.

        Retention evicted them (their rows are ``deleting``), but a registered
        tier has no whole copy yet, so their files stay on disk until the
        replicator finishes (or the tier is detached).

        Returns:
            (checkpoint, tier it waits for) pairs, by checkpoint id.

        Raises:
            LedgerError: When the reader is closed.
        """
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

        ``with reader.pin(ckpt, ttl=600) as pin: reader.load(pin)``. Retention
        may evict the checkpoint meanwhile, but its file stays (its row
        ``deleting``) until the last pin is released or has expired; then the
        writer's next commit, ``gc``, reconcile or ``close()`` removes it. The
        lease is renewed every ``ttl / 3`` seconds while held, so a reader
        that crashes pins for at most ``ttl``; an expired lease is never
        renewed (the writer may have acted on it), and ``pin.lost`` then says
        so. Lease times are the hosts' clocks: keep them in sync (NTP) to well
        within a TTL. The pin is released when the reader closes, if not
        before.

        Args:
            which: Anything :meth:`resolve` takes, in this run (default
                ``"latest"``).
            stream: The stream to resolve ``which`` in, as for :meth:`resolve`.
            ttl: The lease's length in seconds (default 600), more than 0 and
                less than ``10**7``.
            holder: A name for who holds the pin, recorded after the host and
                process id (``ckptdb pins`` shows it); None (the default) for
                none.

        Returns:
            The pin, held; release it (or leave its ``with`` block) when done.

        Raises:
            CheckpointNotFoundError: When ``which`` names no committed
                checkpoint: one already evicted, lost or corrupt cannot be
                pinned.
            InvalidArgumentError: When ``ttl`` is not a number of seconds in
                that range.
            ArgumentTypeError: When ``holder`` is not a str.
            NetworkFilesystemError: When the run's SQLite ledger is on a
                network filesystem, refused for pins as for writers: pin on
                the run's host, or use PostgreSQL.
            UnknownStreamError: When ``stream`` is not a stream of the run.
            LedgerError: When the reader is closed.
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
        """The run's pins, with the checkpoint each holds (``ckptdb pins ROOT``).

        Every pin row not yet cleared: live, released or expired. The holds a
        :class:`~ckptdb.replication.Replicator` keeps on files waiting for
        their copy are pins too (holder ``ckptdb.replication:<tier>``).

        Returns:
            (pin row, checkpoint) pairs, oldest pin first; a pin row has
            ``holder``, ``created_at``, ``expires_at`` and ``released_at``
            (None while not released).

        Raises:
            LedgerError: When the reader is closed.
        """
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
        """Store values an evaluator computed for a checkpoint.

        Scores live next to the checkpoint's row, so :meth:`best_by` can rank
        checkpoints by them and SQL can join them (view
        ``checkpoint_evaluations``). One row per value in the ``evaluations``
        table; recording a name again for the same checkpoint and evaluator
        replaces it (concurrent recorders of the same values never collide).
        Several evaluators may score one checkpoint. NaN is stored as NULL
        and never ranks. Written in a short transaction of the reader's own.

        Args:
            checkpoint: A :class:`~ckptdb.Checkpoint` of this run, or its id.
            values: Names (str of 1 to 255 characters) to real numbers; at
                least one.
            evaluator: Who computed them: a name of 1 to 255 characters.

        Raises:
            ArgumentTypeError: When ``checkpoint`` is neither a Checkpoint nor
                an int, ``values`` is not a mapping, or a name or value has
                the wrong type (a bool is not a number).
            InvalidArgumentError: When ``evaluator`` is not a name of 1 to 255
                characters, or ``values`` is empty.
            CheckpointNotFoundError: When the id is not a checkpoint of this
                run.
            NetworkFilesystemError: When the run's SQLite ledger is on a
                network filesystem.
            LedgerError: When the reader is closed.
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
        """The values recorded for a checkpoint by :meth:`record_evaluation`.

        Args:
            checkpoint: A :class:`~ckptdb.Checkpoint`, or its id.

        Returns:
            evaluator -> name -> value; a value recorded as NaN is None.
            Empty when nothing is recorded.

        Raises:
            LedgerError: When the reader is closed.
        """
        ident = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
        self._open()
        found: dict[str, dict[str, float | None]] = {}
        with self._db.transaction(read=True) as session:
            for row in evaluations.of_checkpoint(session, ident):
                found.setdefault(row.evaluator, {})[row.name] = row.value
        return found

    def last_evaluated(self, evaluator: str, stream: str = "model") -> int | None:
        """The id of the newest checkpoint of a stream that an evaluator scored.

        This is where a restarted ``ckptdb follow`` continues: its cursor is
        its own evaluations, so two evaluators need two names.

        Args:
            evaluator: The evaluator's name, as given to
                :meth:`record_evaluation`.
            stream: The stream (default ``"model"``).

        Returns:
            The checkpoint id, or None when the evaluator recorded nothing for
            the stream.

        Raises:
            LedgerError: When the reader is closed.
        """
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
        """Committed checkpoints ranked by an evaluated value, best first.

        What ``ckptdb best ROOT --by NAME`` shows. Only committed checkpoints
        rank (the ones that can still be loaded), and a value recorded as NaN
        never does. Ties go to the earlier step. A checkpoint several
        evaluators scored appears once, with its best value.

        Args:
            name: The value's name, as recorded with :meth:`record_evaluation`.
            mode: ``"max"`` (the default): larger is better; ``"min"``:
                smaller is better.
            evaluator: Only this evaluator's values; None (the default) for
                every evaluator's.
            stream: Only this stream's checkpoints; None (the default) for
                every stream's.

        Returns:
            (checkpoint, value, evaluator) triples, best first; empty when
            nothing is scored.

        Raises:
            InvalidArgumentError: When ``mode`` is neither ``"min"`` nor
                ``"max"``.
            UnknownStreamError: When ``stream`` is not a stream of the run.
            LedgerError: When the reader is closed.
        """
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
        """Check the run's consistency invariants (``ckptdb check ROOT``).

        What :meth:`ckptdb.CheckpointManager.check` finds without ``load``:
        each committed file's size and hash against its row, the disk against
        the ledger, the latest pointers and retention, every recorded
        export's files (see :mod:`ckptdb.protocol.check`). It writes nothing
        to the ledger or the checkpoints, and holds the run's writer lock
        while it looks (its lock file; on PostgreSQL, its advisory lock), so
        that a trainer's checkpoint in flight is never reported. So it cannot
        run beside a trainer, unlike every other reader call.

        Returns:
            The violations, one line each; empty when the run is consistent.

        Raises:
            LedgerLockedError: When another process (a trainer) holds the
                run's writer lock; the error names it.
            RunDirectoryError: When the run's lock file cannot be used.
            LedgerError: When the reader is closed.
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

        The checkpoint is verified against its row before a byte of it is
        read. It may be a state dict saved with ``torch.save``, a Lightning
        ``.ckpt``, an HF Trainer ``checkpoint-N/`` (its config and tokenizer
        files are copied, so ``from_pretrained(to)`` loads it) or a sharded
        DCP checkpoint saved on any number of ranks, consolidated one tensor
        at a time. Weights above ``max_shard_size`` are split into
        ``model-0000k-of-0000n.safetensors`` with an index, as Hugging Face
        splits them.

        The export is written through a hidden temporary beside ``to``, moved
        into place by one rename, and recorded (table ``exports``) once
        complete and in place, so a recorded export is always whole. A crash
        while it is written leaves only the hidden temporary (the next export
        there removes it); one between the rename and the record leaves a
        complete directory without a row. See :mod:`ckptdb.exports` and
        docs/export.md.

        Args:
            which: Anything :meth:`resolve` takes, in this run (default
                ``"latest"``).
            to: The directory to write: absent or empty, and outside the run's
                save directory.
            stream: The stream to resolve ``which`` in, as for :meth:`resolve`.
            format: The format to write; ``"safetensors"`` (the default) is
                the only one.
            key: The entry of a saved dict to export, such as ``"model"``;
                None (the default): the dict itself when it holds tensors
                only, or a Lightning checkpoint's ``state_dict``.
            max_shard_size: The largest shard, in bytes or as text such as
                ``"5GB"`` or ``"500MiB"`` (default ``"5GB"``).
            trust_pickle: Unpickle a file that holds more than tensors and
                plain values (default False; only for files you trust).

        Returns:
            What was done: ``.export``, the recorded
            :class:`~ckptdb.record.Export` (``path``, ``files``, ``size``,
            ``hash``, ``tensors``); ``.skipped``, the entries that are not
            tensors (left out); ``.aliases``, the tied weights written once
            (``{left out: kept}``).

        Raises:
            ExportTargetError: When ``to`` is not empty, is a file or a link,
                or lies inside the run's save directory.
            CheckpointNotFoundError: When ``which`` names no committed
                checkpoint, or one of another run (open a reader on that run).
            CorruptCheckpointError: When the checkpoint's size or hash differs
                from its row, or a safetensors file in it is damaged.
            CheckpointLostError: When the checkpoint's file is gone.
            InvalidArgumentError: When ``format``, ``key``, ``to`` or
                ``max_shard_size`` is not valid, the checkpoint holds no
                tensors or no state dict (pick one with ``key``), or it holds
                other objects and ``trust_pickle`` is False.
            NetworkFilesystemError: When the run's SQLite ledger is on a
                network filesystem (the export is recorded there).
            UnknownStreamError: When ``stream`` is not a stream of the run.
            LedgerError: When the reader is closed.
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
        """The run's recorded exports (``ckptdb list`` shows them beside their checkpoints).

        Only complete exports are recorded, so each listed directory was
        whole when it was recorded (:meth:`check` verifies its files).

        Args:
            checkpoint: Only this checkpoint's exports (a
                :class:`~ckptdb.Checkpoint`, or its id); None (the default)
                for every export of the run.

        Returns:
            The exports, oldest first.

        Raises:
            ArgumentTypeError: When ``checkpoint`` is neither a Checkpoint,
                an int nor None.
            LedgerError: When the reader is closed.
        """
        ident = checkpoint.id if isinstance(checkpoint, Checkpoint) else checkpoint
        if ident is not None and (isinstance(ident, bool) or not isinstance(ident, int)):
            raise ArgumentTypeError(f"checkpoint must be a Checkpoint or an id, got {checkpoint!r}")
        self._open()
        with self._db.transaction(read=True) as session:
            return ledger_exports.of_run(session, self.run_id, ident)

    def state_counts(self) -> dict[str, int]:
        """How many checkpoint rows the run has in each state, counted by the database.

        Returns:
            State (``committed``, ``deleted``, ``pending``...) -> count; a
            state without any row is absent.

        Raises:
            LedgerError: When the reader is closed.
        """
        return self._open().state_counts()

    def committed_counts(self) -> dict[str, int]:
        """How many committed checkpoints each stream has, counted by the database.

        Counted in SQL, so a status of a run of thousands of checkpoints
        builds no record per checkpoint.

        Returns:
            Stream -> count; a stream without any committed checkpoint is
            absent.

        Raises:
            LedgerError: When the reader is closed.
        """
        return self._open().committed_counts()

    def goodput(self) -> GoodputReport:
        """Where the run's wall-clock time went, over all its attempts (``ckptdb goodput``).

        Productive, saving, lost (redone), restart and idle seconds, per
        attempt and in total, and the checkpoint interval
        ``interval="auto"`` would choose next, on the last attempt's host
        within the default bounds (see :mod:`ckptdb.goodput` and
        docs/goodput.md).

        Returns:
            A report: ``total`` and each attempt's ``breakdown`` (in
            ``attempts``) with ``productive_s``, ``saving_s``, ``lost_s``,
            ``restart_s``, ``idle_s``, ``total_s`` and ``goodput`` (``as_json()``
            flattens them), and ``interval``, the
            :class:`~ckptdb.goodput.IntervalChoice` ``"auto"`` would make.

        Raises:
            LedgerError: When the reader is closed.
        """
        queries = self._open()
        return goodput.report(queries.db, self.run_id, self.run_name)

    def attempts(self) -> list[m.Attempt]:
        """The run's attempts: each process's life on the run, oldest first.

        Every open of the run by a :class:`~ckptdb.CheckpointManager` (a
        training process, or the ``ckptdb`` command's maintenance) starts
        one.

        Returns:
            The attempt rows: ``started_at``, ``ended_at``, ``host``, ``pid``,
            ``kind`` (``train`` or ``maintenance``), ``world_size``,
            ``resumed_from_id`` and ``end_state`` (``running`` until it ends,
            then ``closed``, ``failed``, ``crashed`` or ``preempted``).

        Raises:
            LedgerError: When the reader is closed.
        """
        return self._open().attempts()

    def events(self, limit: int = 10) -> list[m.Event]:
        """The run's newest events (the ledger's ``events`` table).

        Args:
            limit: How many (default 10).

        Returns:
            The newest ``limit`` event rows, oldest first: ``kind``, ``time``,
            ``attempt_id``, ``checkpoint_id``, ``step`` and ``detail`` (JSON
            text, or None).

        Raises:
            LedgerError: When the reader is closed.
        """
        return self._open().events(limit)

    def events_of(self, *kinds: str) -> list[m.Event]:
        """Every event of the given kinds.

        Args:
            *kinds: The event kinds (``preempted``, ``resumed``...; the full
                list is in docs/ledger.md).

        Returns:
            The event rows of those kinds, all of them, oldest first.

        Raises:
            LedgerError: When the reader is closed.
        """
        return self._open().events_of(*kinds)

    def preemptions(self) -> list[dict[str, Any]]:
        """What each preemption of the run cost (``ckptdb status``'s preemptions).

        Read from the run's ``preempted``, ``preemption_saved`` and
        ``resumed`` events.

        Returns:
            One dict per preempted attempt, oldest first: ``attempt``;
            ``step``, the step the ranks agreed to stop at; ``signal`` and
            ``ranks``, the signal and the ranks that received it; ``saved``,
            whether its checkpoint was saved (None: not known); ``why``, the
            reason it was not; ``resumed_from``, the step training resumed
            from (the next attempt's resume, else the saved step; None while
            neither is known); ``lost``, the steps that cost (None likewise).

        Raises:
            LedgerError: When the reader is closed.
        """
        return preemption_summary(self.events_of(*PREEMPTION_EVENTS))

    def metric_history(self, name: str) -> list[tuple[int, float, int]]:
        """Every recorded value of one metric, across the run's attempts.

        A step redone after a crash appears once per attempt that logged it,
        so the history shows what each attempt saw.

        Args:
            name: The metric's name.

        Returns:
            (step, value, attempt id) triples, by step then attempt; a value
            stored as NULL comes back as NaN. Empty for an unknown name.

        Raises:
            LedgerError: When the reader is closed.
        """
        return self._open().metric_history(name)

    def metric_names(self) -> list[str]:
        """The names of every metric recorded for the run.

        Returns:
            The names, sorted.

        Raises:
            LedgerError: When the reader is closed.
        """
        return self._open().metric_names()

    def sql(self, statement: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only SQL query on the ledger (``ckptdb sql``).

        A statement that would write is refused by the database itself
        (SQLite ``query_only``, PostgreSQL ``READ ONLY`` transactions), not by
        inspecting its text. The statement goes to the driver as it is, so a
        literal ``%`` needs no escaping. The ledger holds every run of a
        shared database: filter by ``run_id`` (:attr:`run_id`) where that
        matters.

        Args:
            statement: One SQL statement that returns rows.

        Returns:
            The column names, and the rows as tuples.

        Raises:
            InvalidArgumentError: When the statement returns no rows, would
                write, or fails (the database's first line of error).
            LedgerError: When the reader is closed.
        """
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

    Every answer comes from the ledger of the run that owns the checkpoint,
    never from another run's ledger and never from file names or mtimes, so
    ``--init-from runs/pretrain`` picks the pretraining run's latest even
    while a manager of the new run is open. It opens a
    :class:`RunReader` on that run and closes it again.

    Args:
        spec: What the restart argument holds:

            - ``"latest"``, ``"best"`` or a step (an int, or a string of
              digits that is not an existing path): in the run at ``root``;
            - a :class:`~ckptdb.Checkpoint`, or the path of a checkpoint: in
              the run that holds it, found from the path (a run root above
              it, its ledger there or in ``db_url``, or a Lightning-style
              ``.<dirpath>.ckptdb`` ledger beside a directory), else
              ``root`` (a save directory outside the run root needs it);
            - the root of a run: that run's latest (of ``stream``; else
              ``model``; else its newest committed checkpoint).
        root: The run to look in for ``"latest"``, ``"best"``, a step or an
            object-store location, and the fallback for a path in no run;
            None (the default) for none.
        db_url: The ledger's URL when it is not a run's own SQLite file (a
            PostgreSQL ledger); None (the default) for the run's own.
        stream: The stream: None (the default) means ``model`` for
            ``"latest"`` and steps, ``best`` for ``"best"``, and for a run
            root ``model`` if the run has it, else its newest committed
            checkpoint of any stream.

    Returns:
        The committed checkpoint.

    Raises:
        CheckpointNotFoundError: When nothing committed matches, or a path is
            in no ckptdb run and no ``root`` is given.
        InvalidArgumentError: When ``"latest"``, ``"best"``, a step or an
            object-store location comes without ``root``, or a step is out of
            range.
        ArgumentTypeError: When ``spec`` is none of the above.
        UnknownStreamError: When ``stream`` is not a stream of the run.
        LedgerError: When the run's root holds no ckptdb run, or its ledger
            cannot be opened.
        SchemaVersionError: When that ledger is not at this ckptdb's schema.
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
