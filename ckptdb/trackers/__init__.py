"""Followers that mirror a run into the experiment tracker a team uses.

A tracker (MLflow, Weights & Biases) knows nothing of which checkpoint is
latest, best or survived a crash, and a training script that logs to it
starts a new tracker run at every restart. A :class:`Mirror` reads the run's
ledger instead and mirrors it, pass after pass, into **one** tracker run for
the ckptdb run, however many attempts it has:

1. the tracker run: found by the tag ``ckptdb.run`` (the run's token) or
   created, its id kept in the ledger (table ``trackers``);
2. the metrics, each point of the ledger once, with its step and wall time,
   after the cursor the ledger keeps (the id of the last point mirrored);
3. each committed checkpoint of the followed streams, logged with its step
   and metrics, verified against its row first;
4. ``latest`` and ``best`` of each stream, as the ledger has them;
5. a checkpoint retention evicted (or found lost, corrupt): its copy in the
   tracker removed or marked, as ``on_evict`` says.

**Never twice.** The cursor and what was logged are written to the ledger
after each step; a follower killed between a log and that write finds, when
it starts again, what the tracker already holds (the sink asks the tracker:
the points of each metric key, batch after batch until a batch holds none;
the files of a checkpoint's artifact) and logs only the rest. A tracker
whose writes are asynchronous (W&B) is asked at the open what it holds, and
the cursor goes back to that. One follower per run and kind of tracker at a time: a
file lock in the run's root.

A sink (:mod:`.mlflow`, :mod:`.wandb`) is the tracker's side of this: the
few calls the mirror makes, in the tracker's own API.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from filelock import FileLock, Timeout

from ..errors import (
    CheckpointLostError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    LedgerLockedError,
    MissingExtraError,
)
from ..ledger import Ledger, open_ledger
from ..ledger import trackers as ledger_trackers
from ..ledger.netfs import check_ledger_location
from ..ledger.runs import ledger_url
from ..ledger.trackers import Point
from ..location import ObjectPath
from ..reader import RunReader
from ..record import Checkpoint
from ..storage.naming import run_token
from ..storage.opening import open_verified_payload

log = logging.getLogger("ckptdb.trackers")

#: What happens to an evicted checkpoint's copy in the tracker.
ON_EVICT = ("mark", "delete")
#: Metric points mirrored per tracker call.
BATCH = 1000
#: The lease on a checkpoint while it is logged (renewed while held; seconds).
PIN_TTL = 600.0
#: How often a follower looks for news (seconds).
POLL = 2.0


@dataclass(frozen=True)
class Logged:
    """Where a checkpoint went in the tracker, as the ledger keeps it.

    Attributes:
        where: The copy's address in the tracker (MLflow: its artifact path;
            W&B: ``<artifact>:ckpt-<id>``).
        version: The registered model's version it became (MLflow with
            ``model_name``); None otherwise.
    """

    where: str
    version: str | None = None


class Sink(Protocol):
    """The tracker's side of a mirror: the few calls a :class:`Mirror` makes.

    :class:`~ckptdb.trackers.mlflow.MlflowSink` and
    :class:`~ckptdb.trackers.wandb.WandbSink` implement it, each in its
    tracker's own API; the mirror keeps the cursor and what was logged in the
    ledger, so a sink holds no state that must survive a restart.
    """

    kind: str
    #: Identifies the tracker run's home (URI and experiment, a project): the ledger's key.
    target: str

    def open(self, token: str, run_name: str, known: str | None, streams: list[str]) -> str:
        """Open the tracker run for a ckptdb run: found, or created.

        Args:
            token: The ckptdb run's token, which identifies it in the tracker.
            run_name: The ckptdb run's name, for a tracker run created here.
            known: The tracker run's id as the ledger keeps it; None when the
                ledger has none (then it is found by the token, or created).
            streams: The streams whose checkpoints are followed.

        Returns:
            The tracker run's id, for the ledger to keep.
        """

    def holds(self) -> Held | None:
        """What the tracker run holds, when its writes are asynchronous.

        Returns:
            The last metric point and the checkpoints it holds; None for a
            tracker whose calls return once the data is stored.
        """

    def already_logged(self, points: list[Point]) -> set[int]:
        """Which points the tracker holds already (a crash after a log).

        Args:
            points: Metric points of the ledger, oldest first.

        Returns:
            The ids of those the tracker holds.
        """

    def log_metrics(self, points: list[Point]) -> None:
        """Log metric points, each with its step and wall time.

        Args:
            points: Metric points of the ledger, oldest first.
        """

    def log_checkpoint(self, checkpoint: Checkpoint, local: Path, aliases: list[str]) -> Logged:
        """Log a verified checkpoint with its step and metrics.

        A copy the tracker holds whole already is not logged again.

        Args:
            checkpoint: The checkpoint, as the ledger records it.
            local: Its file or directory on disk, verified against its row.
            aliases: Those of ``latest``/``best`` it holds in the ledger (a
                hint: the mirror sets them with :meth:`set_aliases`
                afterwards in any case).

        Returns:
            Where it went in the tracker.
        """

    def set_aliases(self, stream: str, wanted: dict[str, Aliased]) -> None:
        """Point ``latest`` (and ``best``, for a top-K stream) of a stream at these.

        Args:
            stream: The stream.
            wanted: Alias (``latest``, ``best``) -> the checkpoint it should
                name.
        """

    def evict(self, checkpoint: Checkpoint, logged: Logged, how: str) -> None:
        """Mark or remove the tracker's copy of a checkpoint retention evicted.

        Args:
            checkpoint: The checkpoint; its ``state`` is not ``committed``.
            logged: Where it went in the tracker.
            how: ``"mark"`` or ``"delete"`` (see :data:`ON_EVICT`).
        """

    def check_eviction(self, how: str) -> None:
        """Refuse an ``on_evict`` this sink cannot do, before anything is mirrored.

        Args:
            how: ``"mark"`` or ``"delete"``.

        Raises:
            InvalidArgumentError: When this sink cannot evict that way.
        """

    def close(self) -> None:
        """Release what the sink holds open (the tracker run)."""


@dataclass(frozen=True)
class Held:
    """What an asynchronous tracker run holds, read back when a follower opens it.

    Attributes:
        metric_id: The id of the last ledger metric point it holds (0: none).
        checkpoints: The ledger ids of the checkpoints it holds.
    """

    metric_id: int
    checkpoints: set[int]


@dataclass(frozen=True)
class Aliased:
    """A checkpoint an alias should name.

    Attributes:
        checkpoint: The checkpoint.
        logged: How it was logged.
        local: Returns its verified local copy; a callable, since only a sink
            that logs it again (W&B) needs it.
    """

    checkpoint: Checkpoint
    logged: Logged
    local: Callable[[], Path]


@dataclass
class Pass:
    """What one pass of :meth:`Mirror.sync` mirrored.

    True when the pass mirrored anything (metrics, checkpoints, aliases or
    evictions; refused checkpoints do not count), so ``if mirror.sync():``
    tells a busy pass from an idle one.

    Attributes:
        metrics: How many metric points were logged.
        checkpoints: The checkpoints logged, by id.
        aliases: The aliases moved: ``"<alias>:<stream>"`` (``latest:model``)
            -> the id of the checkpoint it names after the pass.
        evicted: The ids of the checkpoints whose tracker copies were marked
            or deleted.
        refused: Checkpoints that did not match their rows (lost, corrupt):
            id -> why. Not logged, and tried again at the next pass (the run's
            writer marks them at its next load or reconcile).
    """

    metrics: int = 0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    aliases: dict[str, int] = field(default_factory=dict)
    evicted: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.metrics or self.checkpoints or self.aliases or self.evicted)


class Mirror:
    """Mirrors one ckptdb run into one tracker run, across every restart of either.

    What ``ckptdb follow ROOT --to mlflow|wandb`` runs. Each pass mirrors the
    ledger's metric points (each once, with its step and wall time), each
    committed checkpoint of the followed streams (pinned and verified
    against its row first), ``latest`` and ``best`` as the ledger has them,
    and evictions (see the module doc and docs/trackers.md). The cursor and
    what was logged are kept in the ledger (table ``trackers``) after each
    step, and a restarted follower asks the tracker what it holds, so
    nothing is logged twice.

    A follower is a reader of the run: it runs beside the trainer, takes no
    writer lock and writes only its own row. One follower per run and kind
    of tracker at a time (a file lock in the run's root). Opening it finds or
    creates the tracker run; use it as a context manager, or call
    :meth:`close`.

    Args:
        root: The run's root directory.
        sink: The tracker's side: a
            :class:`~ckptdb.trackers.mlflow.MlflowSink` or
            :class:`~ckptdb.trackers.wandb.WandbSink`. The mirror closes it.
        db_url: The ledger's URL when it is not the run's own SQLite file
            (a PostgreSQL ledger); None (the default) for the run's own.
        streams: The streams whose checkpoints are logged; None (the
            default) for every stream of the run.
        on_evict: What happens to the tracker's copy of a checkpoint that
            retention evicted (or the writer found lost or corrupt):
            ``"mark"`` (the default: tag the copy, keep it) or ``"delete"``
            (remove it from the tracker).

    Attributes:
        sink: The sink it mirrors into.
        on_evict: ``"mark"`` or ``"delete"``.
        streams: The followed streams, sorted.

    Raises:
        InvalidArgumentError: When ``on_evict`` is neither ``"mark"`` nor
            ``"delete"`` (or the sink cannot do it: W&B offline cannot
            delete), ``streams`` is a str, empty or names a stream the run
            lacks, or the run's checkpoints are on object storage (a follower
            logs checkpoints from a local disk).
        LedgerLockedError: When another follower mirrors the run into the
            same kind of tracker.
        NetworkFilesystemError: When the run's SQLite ledger is on a network
            filesystem.
        LedgerError: When ``root`` holds no ckptdb run, or its ledger cannot
            be opened.
        SchemaVersionError: When the ledger is not at this ckptdb's schema.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        sink: Sink,
        *,
        db_url: str | None = None,
        streams: Iterable[str] | None = None,
        on_evict: str = "mark",
    ) -> None:
        if on_evict not in ON_EVICT:
            raise InvalidArgumentError(f"on_evict must be one of {ON_EVICT}, got {on_evict!r}")
        sink.check_eviction(on_evict)
        self.sink, self.on_evict = sink, on_evict
        self._reader = RunReader(root, db_url=db_url)
        self._ledger: Ledger | None = None
        self._checked = False  # what the tracker holds after the cursor, looked at once
        self._refused: set[int] = set()  # checkpoints said not to match their rows
        self._lock = FileLock(
            str(self._reader.root / f".ckptdb-follow-{sink.kind}.lock"), timeout=0
        )
        try:
            self.streams = _chosen(streams, sorted(self._reader.policies))
            if isinstance(self._reader.save_dir, ObjectPath):
                raise InvalidArgumentError(
                    f"the checkpoints of {self._reader.root} are on object storage: a follower "
                    "logs checkpoints from a local disk"
                )
            try:
                self._lock.acquire()
            except Timeout:
                raise LedgerLockedError(
                    f"another follower mirrors {self._reader.root} into {sink.kind}: one at a time"
                ) from None
            url = ledger_url(self._reader.root, db_url, readonly=False)
            check_ledger_location(url)
            self._ledger = open_ledger(url)
            with self._ledger.transaction() as session:
                self.state = ledger_trackers.claim(
                    session, self._reader.run_id, sink.kind, sink.target
                )
            created = self._reader.run_created_at
            assert created is not None
            token = run_token(self._reader.run_name, self._reader.run_id, created)
            self.state.external_id = sink.open(
                token, self._reader.run_name, self.state.external_id, self.streams
            )
            self._believe_the_tracker()
            self._save()
        except BaseException:
            self.close()
            raise

    def _believe_the_tracker(self) -> None:
        """A tracker that logs asynchronously (W&B) may have lost what the ledger says
        was mirrored (the follower killed before the tracker's own writer caught up):
        go back to what the tracker holds, and log the rest again."""
        held = self.sink.holds()
        if held is None:
            return
        self.state.metric_cursor = min(self.state.metric_cursor, held.metric_id)
        for ident in [i for i in self.state.logged if int(i) not in held.checkpoints]:
            del self.state.logged[ident]  # logged again (the same files: the same version)

    @property
    def tracker_run_id(self) -> str | None:
        """The tracker run's id (MLflow's run id, W&B's ``ckptdb-<token>``)."""
        return self.state.external_id

    def sync(self) -> Pass:
        """Mirror what is new in the ledger: one pass.

        In order: the metric points after the cursor, the committed
        checkpoints not yet logged (by id), ``latest`` and ``best`` of each
        followed stream, then the evictions. Each checkpoint is pinned while
        it is logged, so retention cannot remove its file mid-upload; one
        that does not match its row is left out (see :attr:`Pass.refused`)
        and one evicted before it was pinned is skipped. What is done is
        written to the ledger step by step, so a pass that fails part way
        loses nothing: the next pass (or a restarted follower) continues.

        Returns:
            What the pass mirrored; false when it found nothing new.

        Raises:
            Exception: What the tracker's client raised (a server that does
                not answer, say); the pass stops there.
        """
        done = Pass()
        done.metrics = self._metrics()
        committed = {s: self._reader.checkpoints(s) for s in self.streams}
        holding = self._holding()
        for checkpoint in sorted((c for cs in committed.values() for c in cs), key=lambda c: c.id):
            if str(checkpoint.id) in self.state.logged:
                continue
            try:
                self._log_checkpoint(checkpoint, holding.get(checkpoint.id, []))
            except (CheckpointLostError, CorruptCheckpointError) as exc:
                # the run's writer marks it at its next load or reconcile; until then a
                # pass logs the others and tries it again
                done.refused[checkpoint.id] = str(exc)
                if checkpoint.id not in self._refused:
                    log.warning("ckptdb: not mirrored: %s", exc)
                    self._refused.add(checkpoint.id)
                continue
            except CheckpointNotFoundError:
                continue  # evicted since this pass listed it: never logged, nothing to mark
            done.checkpoints.append(checkpoint)
        done.aliases = self._aliases(committed)
        done.evicted = self._evictions({c.id for cs in committed.values() for c in cs})
        return done

    def follow(self, *, timeout: float | None = None, poll: float = POLL) -> None:
        """Mirror pass after pass, until the run is quiet for ``timeout`` seconds.

        Sleeps ``poll`` seconds after each :meth:`sync`. A pass that mirrored
        nothing counts toward the timeout; one that mirrored anything starts it
        again.

        Args:
            timeout: Return after that many seconds without news; None (the
                default): follow until interrupted.
            poll: Seconds between two passes (default 2).

        Raises:
            Exception: What a pass raised (see :meth:`sync`).
        """
        quiet_since = time.monotonic()
        while True:
            if self.sync():
                quiet_since = time.monotonic()
            elif timeout is not None and time.monotonic() - quiet_since >= timeout:
                return
            time.sleep(poll)

    # ------------------------------------------------------------------ steps

    def _metrics(self) -> int:
        assert self._ledger is not None
        mirrored = 0
        while True:
            with self._ledger.transaction(read=True) as session:
                points = ledger_trackers.metrics_after(
                    session, self._reader.run_id, self.state.metric_cursor, BATCH
                )
            if not points:
                return mirrored
            last = points[-1].id
            if not self._checked:
                # a follower killed between a log and its cursor's write, or another row's
                # follower (another spelling of the target) logged some of these already:
                # ask the tracker, batch after batch, until a batch holds none of them
                there = self.sink.already_logged(points)
                points = [p for p in points if p.id not in there]
                self._checked = not there
            if points:
                try:
                    self.sink.log_metrics(points)
                except BaseException:
                    self._checked = False  # the tracker may have applied it: ask again
                    raise
                mirrored += len(points)
            self.state.metric_cursor = last
            self._save()

    def _holding(self) -> dict[int, list[str]]:
        """Checkpoint id -> the aliases (latest, best) it holds in the ledger now."""
        held: dict[int, list[str]] = {}
        for stream in self.streams:
            for alias, checkpoint in self._wanted(stream).items():
                if checkpoint is not None:
                    held.setdefault(checkpoint.id, []).append(alias)
        return held

    def _wanted(self, stream: str) -> dict[str, Checkpoint | None]:
        wanted: dict[str, Checkpoint | None] = {"latest": self._reader.latest(stream)}
        if self._reader.policies[stream].ranking_metric is not None:
            best = self._reader.best(stream)
            wanted["best"] = best[0] if best else None
        return wanted

    def _verified(self, checkpoint: Checkpoint) -> Path:
        store, rel = open_verified_payload(
            self._reader.save_dir, checkpoint.path, checkpoint.size, checkpoint.hash, keep=False
        )
        return store.local_path(rel)

    def _log_checkpoint(self, checkpoint: Checkpoint, aliases: list[str]) -> None:
        # pinned: retention may evict it meanwhile, but its file stays until it is logged
        with self._reader.pin(
            checkpoint, ttl=PIN_TTL, holder=f"ckptdb follow --to {self.sink.kind}"
        ):
            logged = self.sink.log_checkpoint(checkpoint, self._verified(checkpoint), aliases)
        self.state.logged[str(checkpoint.id)] = {
            "stream": checkpoint.stream,
            "step": checkpoint.step,
            "where": logged.where,
            "version": logged.version,
        }
        self._save()

    def _aliases(self, committed: dict[str, list[Checkpoint]]) -> dict[str, int]:
        changed: dict[str, int] = {}
        for stream in self.streams:
            chosen = {
                alias: Aliased(
                    checkpoint,
                    _logged(self.state.logged[str(checkpoint.id)]),
                    lambda c=checkpoint: self._verified(c),  # type: ignore[misc]
                )
                for alias, checkpoint in self._wanted(stream).items()
                # one committed after this pass listed the stream waits for the next pass
                if checkpoint is not None and str(checkpoint.id) in self.state.logged
            }
            keys = {alias: f"{alias}:{stream}" for alias in chosen}
            if all(self.state.aliases.get(keys[a]) == c.checkpoint.id for a, c in chosen.items()):
                continue
            self.sink.set_aliases(stream, chosen)
            for alias, aliased in chosen.items():
                if self.state.aliases.get(keys[alias]) != aliased.checkpoint.id:
                    changed[keys[alias]] = aliased.checkpoint.id
                self.state.aliases[keys[alias]] = aliased.checkpoint.id
            self._save()
        return changed

    def _evictions(self, committed: set[int]) -> list[int]:
        gone = [int(i) for i in self.state.logged if int(i) not in committed]
        if not gone:
            return []
        states = {c.id: c for c in self._reader.checkpoints(states=_NOT_COMMITTED)}
        evicted = []
        for ident in sorted(gone):
            checkpoint = states.get(ident)
            if checkpoint is None:
                continue  # committed again meanwhile (not listed above): the next pass
            entry = self.state.logged[str(ident)]
            self.sink.evict(checkpoint, _logged(entry), self.on_evict)  # raises: next pass
            del self.state.logged[str(ident)]
            self.state.evicted[str(ident)] = {**entry, "state": checkpoint.state}
            evicted.append(ident)
            self._save()
        return evicted

    def _save(self) -> None:
        assert self._ledger is not None
        with self._ledger.transaction() as session:
            ledger_trackers.save(session, self.state)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the sink, the ledger connection and the reader, and release the follower lock.

        Leaving the ``with`` block calls it. Everything mirrored is in the
        ledger already, so closing loses nothing.
        """
        try:
            self.sink.close()
        finally:
            try:
                if self._ledger is not None:
                    self._ledger.dispose()
                    self._ledger = None
            finally:
                if self._lock.is_locked:
                    self._lock.release()
                self._reader.close()

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_NOT_COMMITTED = ("deleting", "deleted", "lost", "corrupt")


def _logged(entry: dict[str, object]) -> Logged:
    version = entry.get("version")
    return Logged(str(entry["where"]), None if version is None else str(version))


def _chosen(streams: Iterable[str] | None, known: list[str]) -> list[str]:
    if streams is None:
        return known
    if isinstance(streams, str):
        raise InvalidArgumentError(f"streams must be a list of names, got {streams!r}")
    chosen = sorted(set(streams))
    unknown = [s for s in chosen if s not in known]
    if unknown or not chosen:
        raise InvalidArgumentError(
            f"streams {unknown or chosen} are not streams of the run (it has {', '.join(known)})"
        )
    return chosen


def missing_extra(package: str, extra: str) -> MissingExtraError:
    """The error a sink raises when its tracker's package is not installed.

    Args:
        package: The missing package (``mlflow``, ``wandb``).
        extra: The ckptdb extra that installs it.

    Returns:
        A :class:`~ckptdb.errors.MissingExtraError` naming the command to run,
        for the caller to raise.
    """
    return MissingExtraError(
        f"following a run into {extra} needs {package}: pip install 'ckptdb[{extra}]'"
    )


__all__ = [
    "BATCH",
    "ON_EVICT",
    "Aliased",
    "Held",
    "Logged",
    "Mirror",
    "Pass",
    "Sink",
    "missing_extra",
]
