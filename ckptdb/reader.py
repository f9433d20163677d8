"""Read-only access to a run: for the CLI, notebooks and dashboards.

A reader takes no writer lock, starts no attempt and never reconciles, so it
works while a trainer holds the run. SQLite ledgers are opened with
``mode=ro`` and ``PRAGMA query_only`` (a write is refused by SQLite itself, not
by inspecting the statement), each query runs in one snapshot transaction,
and only committed data is visible (WAL readers never see a transaction in
progress). PostgreSQL readers run every transaction as ``REPEATABLE READ,
READ ONLY``: one snapshot of committed data, and the server refuses writes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from .errors import (
    ArgumentTypeError,
    CheckpointLostError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignEntryError,
    InvalidArgumentError,
    LedgerError,
)
from .ledger import RunQueries, follow, open_ledger
from .ledger import models as m
from .ledger.engine import LEDGER_FILE
from .ledger.follow import Waiter
from .ledger.queries import run_sql
from .ledger.rows import to_record
from .ledger.runs import ledger_url, open_as_reader, run_exists
from .policies import Policy
from .record import Checkpoint
from .storage.files import hash_checkpoint
from .storage.kinds import kind_of_path
from .storage.local import LocalStore

__all__ = ["RunReader", "ledger_url", "resolve", "run_exists"]

#: How often a follower of a SQLite ledger looks for new checkpoints (seconds).
POLL_INTERVAL = 0.5
#: On PostgreSQL commits wake followers; this recheck only bounds a missed wake-up.
NOTIFIED_RECHECK = 5.0


class RunReader:
    """Queries one run's ledger without writing anything."""

    def __init__(self, root: str | os.PathLike[str], *, db_url: str | None = None) -> None:
        self.root = Path(root).resolve()
        self._db_url = db_url
        self._db = open_ledger(ledger_url(self.root, db_url, readonly=True), readonly=True)
        self._closed = False
        try:
            run = open_as_reader(self._db, self.root, adopt_single=db_url is None)
        except BaseException:
            self.close()
            raise
        self.run_id, self.run_name, self.save_dir = run.run_id, run.name, run.save_dir
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
            self._db.dispose()

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

        A path outside this run's save directory (the root of *another* run,
        which names that run's latest, or another run's checkpoint) resolves
        through that run's own ledger; everything else in this run's.
        """
        queries = self._open()
        if isinstance(which, (str, os.PathLike)) and which not in ("latest", "best"):
            path = (Path.cwd() / Path(which).expanduser()).resolve()
            if not path.is_relative_to(self.save_dir.resolve()):  # another run's root or file
                return resolve(path, db_url=self._db_url, stream=stream)
        return queries.resolve(which, stream, self.root)

    def load(
        self,
        which: str | int | Checkpoint | os.PathLike[str] = "latest",
        *,
        stream: str | None = None,
        map_location: Any = "cpu",
        weights_only: bool = True,
        into: dict[str, Any] | None = None,
    ) -> Any:
        """Load a committed checkpoint after verifying its size and hash, as the manager does.

        ``which`` is anything :meth:`resolve` takes. A payload that does not
        match its row raises :class:`~ckptdb.errors.CorruptCheckpointError`
        (a vanished one :class:`~ckptdb.errors.CheckpointLostError`) before
        anything is unpickled. A reader never writes to the ledger: the row
        is marked by the run's writer, at its next ``load`` of that checkpoint
        or ``reconcile(verify=True)`` (``ckptdb reconcile --verify``), and
        ``ckptdb check`` reports it meanwhile.
        """
        return load_verified(
            self.resolve(which, stream=stream),
            map_location=map_location,
            weights_only=weights_only,
            into=into,
        )

    def follow(
        self,
        stream: str = "model",
        *,
        since: int | None = None,
        timeout: float | None = None,
        poll: float = POLL_INTERVAL,
    ) -> Iterator[Checkpoint]:
        """Each checkpoint of ``stream`` published from now on, in commit order, once.

        ``since`` is a cursor, a checkpoint id: only checkpoints after it are
        yielded (``since=0``: the stream's whole history; None: what commits
        after this call). Pass the last id you handled to continue after a
        restart without missing or repeating any. A checkpoint evicted (or
        found lost or corrupt) before the follower got to it is still yielded,
        with its ``state`` saying so (``deleting``, ``deleted``, ...): check
        ``checkpoint.state == "committed"`` before loading it.

        On PostgreSQL the writer's commit wakes the follower (``LISTEN/NOTIFY``);
        on SQLite the follower polls every ``poll`` seconds with one indexed
        query. ``timeout``: stop after that many seconds without a new
        checkpoint (None: follow until the caller stops iterating).
        """
        queries = self._open()
        queries.policy(stream)
        waiter = Waiter(self._db, self.run_id)
        try:
            with self._db.transaction(read=True) as session:
                cursor = (
                    since if since is not None else follow.newest_id(session, self.run_id, stream)
                )
            idle_since = time.monotonic()
            while True:
                with self._db.transaction(read=True) as session:
                    found, cursor = follow.published_after(session, self.run_id, stream, cursor)
                    records = [to_record(row, self.save_dir) for row in found]
                yield from records
                now = time.monotonic()
                if records:
                    idle_since = now
                left = None if timeout is None else timeout - (now - idle_since)
                if left is not None and left <= 0:
                    return
                nap = poll if not waiter.notified else NOTIFIED_RECHECK
                waiter.wait(nap if left is None else min(nap, left))
        finally:
            waiter.close()

    def _newest_id(self, stream: str) -> int:
        with self._db.transaction(read=True) as session:
            return follow.newest_id(session, self.run_id, stream)

    def state_counts(self) -> dict[str, int]:
        return self._open().state_counts()

    def attempts(self) -> list[m.Attempt]:
        return self._open().attempts()

    def events(self, limit: int = 10) -> list[m.Event]:
        """The newest ``limit`` events, oldest first."""
        return self._open().events(limit)

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

    - ``"latest"``, ``"best"`` or a step: in the run at ``root`` (of
      ``stream``; ``"latest"`` and steps default to ``model``, ``"best"`` to
      ``best``);
    - a :class:`Checkpoint`, or the path of a checkpoint: in the run that
      holds it, found from the path (its run root, or a Lightning-style
      ``.<dirpath>.ckptdb`` ledger beside a directory), or ``root``;
    - the root of a run (a directory with its ledger): that run's latest
      (of ``stream``; else ``model``; else its newest committed checkpoint).

    Every answer comes from the ledger of the run that owns it, never from
    another run's ledger and never from file names or mtimes. Raises
    :class:`~ckptdb.errors.CheckpointNotFoundError` when nothing committed
    matches.
    """
    if isinstance(spec, bool) or not isinstance(spec, (str, int, Checkpoint, os.PathLike)):
        raise ArgumentTypeError(
            f"spec must be 'latest', 'best', a step, a Checkpoint or a path; got {spec!r}"
        )
    if isinstance(spec, int) or spec in ("latest", "best"):
        if root is None:
            raise InvalidArgumentError(f"resolve({spec!r}) needs root=, the run to look in")
        with RunReader(root, db_url=db_url) as reader:
            return reader._open().resolve(spec, stream, reader.root)
    path = spec.path if isinstance(spec, Checkpoint) else Path(spec).expanduser()
    run_root = _run_root(path, db_url)
    if run_root is not None:
        with RunReader(run_root, db_url=db_url) as reader:
            return _latest_of(reader, stream)
    owner = _owner_of(path, root, db_url)
    with RunReader(owner, db_url=db_url) as reader:
        return reader._open().resolve(path, stream, reader.root)


def load_verified(
    target: Checkpoint, *, map_location: Any, weights_only: bool, into: dict[str, Any] | None
) -> Any:
    """Read a committed checkpoint after checking it against its row; never writes the ledger."""
    path = target.path
    try:
        actual = hash_checkpoint(path)
    except FileNotFoundError as exc:
        raise CheckpointLostError(
            f"{path} is gone (its run's writer marks it lost at its next load or reconcile)"
        ) from exc
    except ForeignEntryError as exc:
        raise CorruptCheckpointError(f"{path}: {exc}; refusing to load it") from exc
    if (actual.size, actual.hash) != (target.size, target.hash):
        raise CorruptCheckpointError(
            f"{path}: size/hash {actual.size}/{actual.hash} != ledger {target.size}/{target.hash}; "
            "refusing to load it (its run's writer marks it corrupt at its next load or "
            "reconcile --verify)"
        )
    kind = kind_of_path(path)
    kind.check_into(str(path), into)
    store = LocalStore(path.parent)
    return kind.load(
        store,
        path.name,
        map_location=map_location,
        weights_only=weights_only,
        into=into,
        group=None,
    )


def _latest_of(reader: RunReader, stream: str | None) -> Checkpoint:
    """A run's latest: of ``stream``, else of ``model``, else its newest committed one."""
    if stream is not None or "model" in reader.policies:
        return reader._open().resolve("latest", stream, reader.root)
    found = reader.checkpoints()
    if not found:
        raise CheckpointNotFoundError(f"run {reader.root} has no committed checkpoint yet")
    return max(found, key=lambda c: (c.committed_at, c.id))


def _run_root(path: Path, db_url: str | None) -> Path | None:
    """``path`` itself, if it is the root of a run (its ledger is there, or in db_url)."""
    if not path.is_dir():
        return None
    resolved = path.resolve()
    if (resolved / LEDGER_FILE).is_file():
        return resolved
    beside = resolved.parent / f".{resolved.name}.ckptdb"  # a Lightning-style dirpath
    if (beside / LEDGER_FILE).is_file():
        return beside
    if db_url is not None and run_exists(resolved, ledger_url(resolved, db_url, readonly=True)):
        return resolved
    return None


def _owner_of(path: Path, root: str | os.PathLike[str] | None, db_url: str | None) -> Path:
    """The root of the run that holds the checkpoint at ``path``."""
    resolved = (Path.cwd() / path).resolve()
    for ancestor in resolved.parents:
        found = _run_root(ancestor, None)
        if found is not None:
            return found
    if root is not None:
        return Path(root).resolve()
    raise CheckpointNotFoundError(
        f"{path} is in no ckptdb run (no ledger above it); pass root= to name the run"
    )
