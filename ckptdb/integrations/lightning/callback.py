"""The ckptdb ``ModelCheckpoint`` for PyTorch Lightning (see the package docstring).

Lightning's own callback, subclassed: it keeps Lightning's arguments, names
and attributes, and hands visibility, retention, ``last`` and resume
resolution to the ledger through the shared integration layer
(:mod:`ckptdb.integrations.common`).
"""

import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Union
from weakref import proxy

import torch
from torch import Tensor

from .. import common

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import Strategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise common.framework_missing(
        "ckptdb.integrations.lightning", "Lightning", "lightning"
    ) from exc

from ...errors import (
    CheckpointLostError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NonFiniteGradientError,
    RunDirectoryError,
    note_on,
)
from ...guard import NonFiniteGradGuard
from ...ledger.runs import ledger_beside
from ...manager import CheckpointManager
from ...policies import Keep, Policy, TopK
from ...preemption import OnPreemption, Preempted, Preemption
from ...record import Checkpoint
from ...storage.alias import point_alias, remove_alias
from ...storage.external import External
from ...storage.files import FileInfo, write_stream
from ..contract import IntegrationLedger, LedgerOptions
from .compat import LightningHooks, dump_checkpoint, positional_like_this_release
from .layout import LAST_SUFFIX, stream_for_monitor

__all__ = ["ModelCheckpoint", "default_ledger", "newest_committed"]

log = logging.getLogger("ckptdb.lightning")


def default_ledger(dirpath: str | os.PathLike[str]) -> Path:
    """Where a ``ModelCheckpoint`` keeps its ledger unless ``ledger=`` says otherwise.

    For ``dirpath`` ``<parent>/<name>`` it is ``<parent>/.<name>.ckptdb``:
    outside ``dirpath``, so that ``dirpath`` holds checkpoints only, and
    unique to it, so that two sibling checkpoint directories never share a
    run (their common parent would mix unrelated runs up). Pass the result
    to ``ckptdb status``, ``ckptdb best`` or a ``RunReader`` to read the run
    a callback trains into. Nothing is created or opened.

    Args:
        dirpath: The callback's checkpoint directory (Lightning's ``dirpath``),
            relative to the working directory or absolute.

    Returns:
        The absolute path of the run root that holds the ledger.

    Raises:
        RunDirectoryError: ``dirpath`` is a filesystem root, which has no parent
            to hold the ledger; pass ``ledger=`` to the callback instead.
    """
    path = Path(dirpath).resolve()
    if path.parent == path:
        raise RunDirectoryError(f"dirpath {path} has no parent to hold its ledger; pass ledger=")
    return ledger_beside(path)


def newest_committed(
    ledger: str | os.PathLike[str], *, db_url: str | None = None
) -> Checkpoint | None:
    """The newest committed checkpoint of any stream whose file is whole (size and hash).

    This is what ``fit(ckpt_path="last")`` resumes from: the newest committed
    row of the ledger, across the callback's top-k and ``last`` streams,
    never a file chosen by its modification time. A checkpoint whose size or
    hash no longer matches its row is skipped with a warning (logger
    ``ckptdb.lightning``) and the previous one is tried. Read-only: it never
    takes the writer lock and marks nothing, so every rank may ask before a
    process group exists, and it works while another process trains.

    Args:
        ledger: The run root holding the ledger (the callback's ``ledger=``, or
            ``default_ledger(dirpath)``).
        db_url: The ledger's SQLAlchemy URL when it is not the run root's
            SQLite file (the callback's ``db_url=``); None for SQLite.

    Returns:
        The checkpoint, or None when the run does not exist yet or has no
        committed checkpoint that is still whole.
    """
    return common.newest_whole_read_only(ledger, db_url=db_url, log=log)


@dataclass
class _Session:
    """One open ledger, shared by the ckptdb callbacks of a Trainer that use it."""

    ledger: IntegrationLedger
    guard: NonFiniteGradGuard | None
    users: set[int] = field(default_factory=set)
    refused_step: int | None = None  # a guard trip refuses every save at that step
    fed: tuple[int, int] | None = None  # (global step, optimizer) the guard last saw
    preemption: Preemption | None = None  # installed at train start by the callback asking


#: Open ledgers by (ledger root, db_url, Trainer): one Trainer's callbacks share
#: one; another Trainer on the same ledger meets its writer lock.
_SESSIONS: dict[tuple[str, str | None, int], _Session] = {}


class ModelCheckpoint(LightningHooks):
    """Lightning's ``ModelCheckpoint``, with its checkpoints committed through a ckptdb ledger.

    A drop-in replacement for ``lightning.pytorch.callbacks.ModelCheckpoint``:
    a subclass with the same name, the same arguments in the same order, the
    same state key and the same attributes (``best_model_path``,
    ``best_k_models``, ``kth_best_model_path``, ``last_model_path``), and
    Lightning's file names (``filename=``, ``auto_insert_metric_name``,
    ``-v1`` suffixes). What decides changes, so that a crash can never leave
    a half-written checkpoint that a resume or an attribute names:

    - Visibility is the commit. Each save is written by Lightning into a
      temporary path (``.<name>.ckptdb-tmp-<id>``), fsynced, measured,
      renamed to Lightning's name and committed as one ledger row; only then
      does it count for ``best_model_path``, ``best_k_models``,
      ``last_model_path`` and ``fit(ckpt_path="last")``. A crash mid-save
      leaves a pending row that the next start rolls back with its file.
    - Retention is the ledger's: the top-k is the stream
      ``TopK(save_top_k, monitor, mode)`` (``Keep`` without a monitor), and a
      file is removed only after the commit that evicted it. The checkpoint a
      run resumed from, and an earlier run's files in the same ``dirpath``,
      stay on disk.
    - ``last.ckpt`` is an alias derived from the ledger: a hard link (a copy
      where links are impossible) to the newest committed checkpoint, swapped
      in after the commit. With ``save_last=True`` a step whose top-k
      checkpoint committed is not written twice; otherwise it is written once
      as ``last-step=<step>.ckpt`` in the ``<stream>.last`` stream.
    - ``fit(ckpt_path="last")`` resumes from the newest committed checkpoint
      whose size and hash match its row (``newest_committed``), and the state
      Lightning restores into the callback is replaced by the ledger's.
    - A name is never written over: a name taken on disk or by a ledger row
      gets ``-vN``, even with ``enable_version_counter=False``.
    - The guard: with ``guard=True`` the gradients of each optimizer step
      feed a ``NonFiniteGradGuard`` (on the device, no host sync); a NaN or
      Inf gradient since the previous checkpoint refuses the next one (every
      save of that step, ``last`` included) on every rank, records a
      ``guard_tripped`` event and logs a warning (logger
      ``ckptdb.lightning``); training goes on. A step the GradScaler skipped
      does not count.
    - The scalar ``trainer.callback_metrics`` of each checkpoint are stored
      with its row and in the ledger's ``metrics`` table.

    The ledger opens when the Trainer sets the callback up for ``fit`` (the
    writer lock is taken and the run reconciled then) and is released at
    teardown or on an exception; ``validate``, ``test`` and ``predict`` never
    take the lock. Nothing is created in the constructor, and the callback
    pickles. Several ckptdb callbacks of one Trainer with the same ``dirpath``
    share one ledger, each with its own streams (the top-k stream is named
    after the monitor, ``checkpoints`` without one; ``last`` checkpoints go to
    ``<stream>.last``); they must agree on ``guard``, ``remote`` and
    ``remote_options``, and only one may ask for ``preemption`` or
    ``train_time_interval="auto"``. ``AsyncCheckpointIO`` is refused at setup:
    it writes after ``save_checkpoint`` returns, so there would be nothing to
    commit. The supported Lightning releases are ``>=2.4,<2.7``; another is
    refused when the module is imported (``UnsupportedVersionError``).

    Args:
        dirpath: Lightning's: the directory of the checkpoints (None: the one
            Lightning derives from the logger and ``default_root_dir``). A
            filesystem path; a URL (``s3://...``, ``file://...``) is refused.
        filename: Lightning's: the checkpoint name template (None: Lightning's
            ``{epoch}-{step}``).
        monitor: Lightning's: the logged metric that ranks the top-k (None:
            keep the newest ``save_top_k`` instead of the best). Also names
            the ledger stream unless ``stream`` is given.
        verbose: Lightning's: log each save decision.
        save_last: Lightning's: True or ``"link"`` keeps ``last.ckpt`` pointing
            at the newest committed checkpoint (a hard link in both cases, not
            a symlink); False or None: no ``last`` alias.
        save_top_k: Lightning's: how many checkpoints the top-k stream keeps
            (-1: all; 0: none, only ``last`` checkpoints).
        save_on_exception: Lightning's (from 2.5.3; ckptdb takes it on every
            supported release, with 2.5.3's rule): checkpoint when training
            raises, into the ``<stream>.last`` stream under a free name. If that
            save fails, the training's own exception is still the one raised.
            On a Lightning before 2.5.3 it must be passed by keyword.
        save_weights_only: Lightning's: save the model's weights only.
        mode: Lightning's: ``"min"`` or ``"max"``, how ``monitor`` ranks.
        auto_insert_metric_name: Lightning's: put ``name=`` before each metric
            of ``filename``.
        every_n_train_steps: Lightning's: save every this many training steps.
        train_time_interval: Lightning's ``timedelta`` between saves, or
            ckptdb's ``"auto"``: save on the interval the ledger chooses (the
            Young/Daly interval from this run's measured save cost and failure
            rate, within ``min_interval`` and ``max_interval``). Like
            Lightning's timed save it excludes ``every_n_train_steps`` and
            ``every_n_epochs``, and ``"auto"`` needs automatic optimization.
        every_n_epochs: Lightning's: save every this many epochs.
        save_on_train_epoch_end: Lightning's: save at the end of the training
            epoch rather than after validation (None: Lightning decides).
        enable_version_counter: Lightning's: version a taken ``last`` name. A
            taken checkpoint name always gets ``-vN`` with ckptdb, whatever
            this says: nothing is ever written over.
        ledger: ckptdb's: the run root that holds ``ckptdb.sqlite`` and the
            writer lock (None: ``default_ledger(dirpath)``). A local path; an
            ``s3://`` URL is refused.
        db_url: ckptdb's: the ledger's SQLAlchemy URL, e.g. PostgreSQL (None:
            SQLite in the run root).
        guard: ckptdb's: True (a non-finite gradient refuses the next
            checkpoint, training goes on), ``"raise"`` (``fit`` raises
            ``NonFiniteGradientError`` instead) or False (no guard).
        stream: ckptdb's: the name of the top-k stream (None: the monitor's
            name, or ``checkpoints`` without a monitor); its ``last``
            checkpoints go to ``<stream>.last``, so it must leave room for that
            suffix within 64 characters.
        preemption: ckptdb's: True (``OnPreemption()``: SIGTERM, no grace
            period, the agreement at every step) or an
            ``OnPreemption(signals=..., grace=..., every=...)``: a preemption
            signal on any rank makes every rank checkpoint the same step into
            the ``last`` stream at a batch end, re-points ``last.ckpt`` at it
            and ends ``fit`` with ``ckptdb.Preempted``. While ``fit`` runs,
            ckptdb's handler replaces Lightning's SIGTERM (and SLURM SIGUSR1)
            handling. False or None: off.
        remote: ckptdb's: where a replicator copies the run (``s3://...``), or
            None. ``fit(ckpt_path="last")`` in one process then brings the
            newest checkpoint back from its copy when it is missing or corrupt
            here; on several processes nothing is restored at resolution (a
            warning says so: run ``ckptdb restore`` before the job).
        remote_options: ckptdb's: options of the ``remote`` object store
            (credentials, endpoint), with ``remote`` only.
        min_interval: ckptdb's: the shortest interval in seconds
            ``train_time_interval="auto"`` may choose (None: 60).
        max_interval: ckptdb's: the longest interval in seconds
            ``train_time_interval="auto"`` may choose (None: 1800).

    Raises:
        InvalidArgumentError: A URL ``dirpath`` or ``ledger``, a
            ``train_time_interval`` string other than ``"auto"`` or one with
            ``every_n_train_steps``/``every_n_epochs``, a bad ``guard``, a bad
            or too long ``stream``, a ``remote`` that is not an object-storage
            URL, interval bounds without ``"auto"`` or out of order, or
            ``remote_options`` without ``remote``.
        ArgumentTypeError: An argument of the wrong type (a ``ledger`` that is
            not a path, a ``db_url`` or ``stream`` that is not a string,
            ``remote_options`` that is not a mapping, a ``preemption`` that is
            neither a bool nor an ``OnPreemption``), or, on a Lightning
            before 2.5.3, a seventh positional argument (pass the arguments
            after ``save_top_k`` by keyword).
    """

    @positional_like_this_release
    def __init__(
        self,
        dirpath: Union[str, Path] | None = None,  # noqa: UP007 (Lightning's CLI reads these)
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: Union[bool, Literal["link"]] | None = None,  # noqa: UP007
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | Literal["auto"] | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        *,
        ledger: Union[str, Path] | None = None,  # noqa: UP007
        db_url: str | None = None,
        guard: Union[bool, Literal["raise"]] = True,  # noqa: UP007
        stream: str | None = None,
        preemption: Union[bool, OnPreemption] | None = None,  # noqa: UP007
        remote: str | None = None,
        remote_options: Mapping[str, object] | None = None,
        min_interval: float | None = None,
        max_interval: float | None = None,
    ) -> None:
        if dirpath is not None and "://" in str(dirpath):
            raise InvalidArgumentError(
                f"dirpath {str(dirpath)!r}: the ckptdb ModelCheckpoint keeps checkpoints on a "
                "local or network filesystem path; pass it as a plain path"
            )
        auto = isinstance(train_time_interval, str)
        if auto and train_time_interval != "auto":
            raise InvalidArgumentError(
                f"train_time_interval is a timedelta or 'auto', got {train_time_interval!r}"
            )
        if auto and (every_n_train_steps or every_n_epochs):
            raise InvalidArgumentError(  # Lightning's own rule for a timed interval
                "train_time_interval='auto' with every_n_train_steps or every_n_epochs: "
                "the three are mutually exclusive"
            )
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=save_top_k,
            save_on_exception=save_on_exception,
            save_weights_only=save_weights_only,
            mode=mode,
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=None if auto else train_time_interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
        )
        #: The ledger options (``db_url``, ``guard``, ``remote``, ``preemption``), checked.
        self.ledger_options = LedgerOptions.of(
            db_url=db_url,
            guard=guard,
            remote=remote,
            remote_options=remote_options,
            preemption=preemption,
            interval="auto" if auto else None,
            min_interval=min_interval,
            max_interval=max_interval,
        )
        if auto:  # as Lightning's timed interval: no epoch-end saves of their own
            self._every_n_epochs = self._every_n_train_steps = 0
        self.ledger = common.check_path(ledger, "ledger")
        self.stream = common.check_stream(stream, suffix=LAST_SUFFIX)
        common.check_local_root(ledger, "ledger")
        self._ckptdb_session_key: tuple[str, str | None, int] | None = None
        #: Ids of the checkpoints this callback committed in the current fit.
        self._ckptdb_published: set[int] = set()

    # ----------------------------------------------------------------- the ledger

    @property
    def guard(self) -> common.GuardSetting:
        """The ``guard=`` setting: True, ``"raise"`` or False."""
        return self.ledger_options.guard

    @property
    def db_url(self) -> str | None:
        """The ledger's SQLAlchemy URL (None: SQLite in the run root)."""
        return self.ledger_options.db_url

    @property
    def preemption(self) -> OnPreemption | None:
        """The preemption settings ``preemption=`` asked for (None: off)."""
        return self.ledger_options.preemption

    @property
    def remote(self) -> str | None:
        """Where a replicator copies the run, which a resume may restore from (or None)."""
        return self.ledger_options.remote

    @property
    def remote_options(self) -> Mapping[str, object] | None:
        """The ``remote`` object store's options, read-only (None without them)."""
        return self.ledger_options.remote_options

    @property
    def main_stream(self) -> str:
        """The ledger stream of this callback's top-k (or every-n) checkpoints."""
        return self.stream if self.stream is not None else stream_for_monitor(self.monitor)

    @property
    def last_stream(self) -> str:
        """The stream of checkpoints written for ``last`` (or on an exception) alone."""
        return f"{self.main_stream}{LAST_SUFFIX}"

    def streams(self) -> dict[str, Policy]:
        """This callback's ledger streams and their retention policies.

        The top-k stream (``main_stream``) is ``TopK(save_top_k, monitor, mode)``
        with a monitor, ``Keep(last=save_top_k)`` without one (-1: keep all),
        and absent when ``save_top_k`` is 0; the ``last`` stream
        (``last_stream``) keeps one checkpoint.

        Returns:
            The policy of each stream, by stream name.
        """
        found: dict[str, Policy] = {}
        if self.save_top_k != 0:
            k = None if self.save_top_k == -1 else self.save_top_k
            found[self.main_stream] = (
                TopK(k, self.monitor, "max" if self.mode == "max" else "min")
                if self.monitor is not None
                else Keep(last=k)
            )
        found[self.last_stream] = Keep(last=1)
        return found

    def _ckptdb_key(self, trainer: pl.Trainer) -> tuple[str, str | None]:
        dirpath = str(self.resolved_dirpath(trainer))
        if "://" in dirpath:
            raise InvalidArgumentError(
                f"dirpath {dirpath!r}: the ckptdb ModelCheckpoint keeps checkpoints on a "
                "local or network filesystem path; pass it as a plain path"
            )
        root = Path(self.ledger).resolve() if self.ledger is not None else default_ledger(dirpath)
        return str(root), self.db_url

    def _ckptdb_session(self, trainer: pl.Trainer) -> _Session:
        """The open ledger (opened at setup, or lazily at the first save)."""
        key = (*self._ckptdb_key(trainer), id(trainer))
        session = _SESSIONS.get(key)
        if session is None:
            session = _SESSIONS[key] = self._ckptdb_open(trainer, key[:2])
        session.users.add(id(self))
        self._ckptdb_session_key = key
        return session

    def _ckptdb_open(self, trainer: pl.Trainer, key: tuple[str, str | None]) -> _Session:
        peers = [
            cb
            for cb in trainer.checkpoint_callbacks
            if isinstance(cb, ModelCheckpoint) and cb._ckptdb_key(trainer) == key
        ] or [self]
        dirpath = Path(self.resolved_dirpath(trainer)).resolve()
        streams: dict[str, Policy] = {}
        for cb in peers:
            other = Path(cb.resolved_dirpath(trainer)).resolve()
            if other != dirpath:
                raise InvalidArgumentError(
                    f"two ckptdb ModelCheckpoint callbacks share the ledger {key[0]} but not "
                    f"their dirpath ({dirpath} and {other}); give each its own ledger="
                )
            for name, policy in cb.streams().items():
                if name in streams:
                    raise InvalidArgumentError(
                        f"two ckptdb ModelCheckpoint callbacks would both use the ledger "
                        f"stream {name!r}; pass stream= to tell them apart"
                    )
                streams[name] = policy
        if sum(cb.preemption is not None for cb in peers) > 1:
            raise InvalidArgumentError(
                f"two ckptdb ModelCheckpoint callbacks sharing the ledger {key[0]} both ask "
                "for preemption=; one preemption checkpoint ends the run: give it to one"
            )
        if len({cb.ledger_options.remote_key() for cb in peers}) > 1:
            raise InvalidArgumentError(
                f"ckptdb ModelCheckpoint callbacks sharing the ledger {key[0]} must agree on "
                f"remote= and remote_options= (got {sorted({repr(cb.remote) for cb in peers})})"
                ": the run has one remote tier"
            )
        if len({cb.guard for cb in peers}) > 1:
            raise InvalidArgumentError(
                f"ckptdb ModelCheckpoint callbacks sharing the ledger {key[0]} must agree on "
                f"guard= (got {sorted({repr(cb.guard) for cb in peers})}): one guard decides "
                "for every checkpoint of a step"
            )
        if isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
            raise InvalidArgumentError(
                "AsyncCheckpointIO writes after save_checkpoint returns, so ckptdb could not "
                "commit what it wrote; remove the AsyncCheckpointIO plugin (the ckptdb "
                "ModelCheckpoint writes and commits in the training loop)"
            )
        guard = None
        if self.guard:
            guard = NonFiniteGradGuard(trainer.lightning_module)
        if sum(cb.ledger_options.interval is not None for cb in peers) > 1:
            raise InvalidArgumentError(
                f"two ckptdb ModelCheckpoint callbacks sharing the ledger {key[0]} both ask "
                "for train_time_interval='auto'; the run has one clock: give it to one"
            )
        asking = [cb.preemption for cb in peers if cb.preemption is not None]
        pacing = [cb.ledger_options.interval for cb in peers if cb.ledger_options.interval]
        options = dataclasses.replace(
            self.ledger_options,
            preemption=asking[0] if asking else None,
            interval=pacing[0] if pacing else None,
        )
        ledger = IntegrationLedger.open(
            key[0], options, streams=streams, save_dir=dirpath, guard=guard
        )
        return _Session(ledger, guard)

    def _ckptdb_release(self, failed: BaseException | None = None) -> None:
        key, self._ckptdb_session_key = self._ckptdb_session_key, None
        session = _SESSIONS.get(key) if key is not None else None
        if session is None:
            return
        session.users.discard(id(self))
        if not session.users:
            del _SESSIONS[key]  # type: ignore[arg-type]
            session.ledger.close(failed)

    # ------------------------------------------------------------ Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lightning's ``setup`` hook: for ``fit``, open the ledger.

        Lightning's own ``setup`` runs first. For ``fit`` the run is opened (or
        shared with the Trainer's other ckptdb callbacks of the same ledger):
        the writer lock is taken, the ledger reconciled with the disk, and
        Lightning's top-k attributes are set from the committed checkpoints.
        ``validate``, ``test`` and ``predict`` save nothing and open nothing,
        so they work while another process trains into the same ``dirpath``.

        Args:
            trainer: The Trainer being set up.
            pl_module: The LightningModule being trained.
            stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.

        Raises:
            LedgerLockedError: Another process trains into this ledger (the error
                names the holder).
            RunDirectoryError: The ledger's run root cannot hold a run (a file, a
                read-only place).
            InvalidArgumentError: The callbacks sharing this ledger disagree
                (``dirpath``, a stream name, ``guard``, ``remote``, more than one
                asking for ``preemption`` or ``train_time_interval="auto"``), the
                resolved ``dirpath`` is a URL, or the strategy's
                ``CheckpointIO`` is an ``AsyncCheckpointIO``.
        """
        super().setup(trainer, pl_module, stage)
        self._ckptdb_published = set()
        if stage == "fit":
            self._ckptdb_sync(self._ckptdb_session(trainer))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Lightning's ``teardown`` hook: release the ledger.

        The last ckptdb callback of the Trainer to leave ends the attempt and
        drops the writer lock, so another process may train into the run.

        Args:
            trainer: The Trainer being torn down.
            pl_module: The LightningModule that was run.
            stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.
        """
        self._ckptdb_release()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Lightning's ``on_exception`` hook: ``save_on_exception``, then release the ledger.

        With ``save_on_exception=True`` (and not during the sanity check or
        ``fast_dev_run``, nor at a step already saved) the checkpoint goes to
        the ``<stream>.last`` stream under a free name, and ``last`` is
        re-pointed at it. It never replaces the training's own error: a save
        that fails here is logged and added as a note to ``exception``, which
        Lightning re-raises. Then the ledger is released and the attempt ends
        as failed. A ``Preempted`` exception's checkpoint is already saved.

        Args:
            trainer: The Trainer that was running.
            pl_module: The LightningModule that was trained.
            exception: What training raised.
        """
        try:
            if (
                not isinstance(exception, Preempted)  # its checkpoint is already dealt with
                and self.should_save_on_exception(trainer)
                and self._ckptdb_session_key is not None
            ):
                candidates = self.monitor_candidates(trainer)
                filepath = self.ckptdb_free_filepath(candidates, trainer)
                self._ckptdb_publish(trainer, self.last_stream, filepath, candidates, None)
                self.ckptdb_save_last(trainer, candidates)
        except Exception as failed:
            log.error("ckptdb: the checkpoint on %s failed: %s", type(exception).__name__, failed)
            note_on(exception, f"ckptdb: the checkpoint on this exception failed: {failed!r}")
        finally:
            self._ckptdb_release(exception)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning's ``on_train_start`` hook: record the resume and protect what must stay.

        Like Lightning, a run never deletes the checkpoint it resumed from: its
        resume is recorded (a ``resumed`` event) and the file protected while
        the run is open. A run that starts afresh in a ``dirpath`` with earlier
        checkpoints (a rerun: Lightning gives its files ``-v1`` names) never
        deletes those either, though they leave its streams when its retention
        says so. After a resume ``last`` is re-pointed at the newest committed
        checkpoint. With ``preemption=``, ckptdb's signal handlers are
        installed here, after Lightning's own, so that they are the ones that
        run.

        Args:
            trainer: The Trainer starting to train.
            pl_module: The LightningModule being trained.

        Raises:
            InvalidArgumentError: ``train_time_interval="auto"`` with manual
                optimization, where Lightning's timed save never runs.
        """
        if self.ledger_options.interval is not None and not pl_module.automatic_optimization:
            raise InvalidArgumentError(
                "train_time_interval='auto' needs automatic optimization: with manual "
                "optimization Lightning saves on every_n_train_steps only"
            )
        super().on_train_start(trainer, pl_module)
        session = self._ckptdb_session(trainer)
        ledger, resumed = session.ledger, trainer.ckpt_path
        if self.preemption is not None and session.preemption is None:
            # now, not at setup: Lightning installs its own SIGTERM handler in between,
            # and ours must be the one that runs (its saves inside the handler)
            session.preemption = ledger.preemption()
        if resumed is None:
            ledger.start_afresh()
        else:  # a warm start from a file that is not this run's protects nothing
            for record in ledger.manager.checkpoints():
                if os.path.abspath(record.path) == os.path.abspath(resumed):
                    ledger.resume_from(record)
        if self.save_last and self.last_model_path:
            target = self._ckptdb_last_target(session, None)  # collective: asked on every rank
            if target is not None and trainer.is_global_zero:
                point_alias(target.path, Path(self.last_model_path))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """Lightning's ``on_before_optimizer_step`` hook: feed the guard this step's gradients.

        With ``guard`` on, the gradients the optimizer is about to apply are
        checked for NaN and Inf on the device (no host sync), once per step and
        optimizer; a step the GradScaler skipped changed no weights and does
        not count. The verdict is read at the next checkpoint.

        Args:
            trainer: The Trainer that is training.
            pl_module: The LightningModule being trained.
            optimizer: The optimizer about to step.
        """
        key = self._ckptdb_session_key
        session = _SESSIONS.get(key) if key is not None else None
        if session is None or session.guard is None:
            return
        fed = (trainer.global_step, id(optimizer))
        if session.fed == fed:
            return
        session.fed = fed
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        session.guard.observe(
            common.optimizer_params(optimizer), skipped=common.skipped_by_scaler(scaler, optimizer)
        )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Lightning's ``on_train_batch_end`` hook: the step's saves, then the preemption check.

        The step is reported to the ledger (so ``ckptdb goodput`` measures the
        run); with ``train_time_interval="auto"`` the ledger says whether a
        checkpoint is due, the same answer on every rank. Then Lightning's own
        every-n and timed saves run, each one ledger boundary.

        With ``preemption=``, every rank then asks whether a preemption signal
        reached any rank. When it did, every rank checkpoints this step into
        the ``last`` stream (a checkpoint of this step already committed here
        counts), ``last`` is re-pointed at it, and ``fit`` ends with
        ``ckptdb.Preempted`` (a ``SystemExit`` with the signal's exit status,
        as Lightning ends on SIGTERM); ``fit(ckpt_path="last")`` resumes from
        it.

        Args:
            trainer: The Trainer that is training.
            pl_module: The LightningModule being trained.
            outputs: What ``training_step`` returned.
            batch: The batch of this step.
            batch_idx: The batch's index in the epoch.

        Raises:
            Preempted: A preemption signal reached a rank (after the agreed
                checkpoint was dealt with).
            NonFiniteGradientError: With ``guard="raise"``, a non-finite
                gradient since the previous checkpoint, at a save.
            PublishError: A save failed on some rank; nothing was published.
        """
        key = self._ckptdb_session_key
        session = _SESSIONS.get(key) if key is not None else None
        if session is not None:
            self._ckptdb_pace(session, trainer.global_step)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.preemption is None or session is None or session.preemption is None:
            return
        stop, step = session.preemption, trainer.global_step
        if stop.requested(step):
            raise stop.stop(step, self._ckptdb_preemption_checkpoint(trainer, session, stop, step))

    @property
    def state_key(self) -> str:
        """Lightning's key of this callback's state in a checkpoint, the same on every batch.

        With ``train_time_interval="auto"`` the interval the callback holds
        changes for a due batch (whose checkpoint stores the state), and a
        resume must find the state under the key it computes then.
        """
        if self.ledger_options.interval is None:
            return super().state_key
        held, self._train_time_interval = self._train_time_interval, None
        try:
            return super().state_key
        finally:
            self._train_time_interval = held

    def _ckptdb_pace(self, session: _Session, step: int) -> None:
        """Report the step (goodput); with ``train_time_interval="auto"``, ask the ledger
        whether it is due and let Lightning's timed save take it (a one-microsecond
        interval for this batch only; every rank has the same answer, so Lightning's broadcast of it
        runs on due steps alone)."""
        if self.ledger_options.interval is None:
            session.ledger.heartbeat(step)
            return
        due = session.ledger.due(step)
        # a microsecond, not zero: Lightning before 2.5 reads a zero timedelta as "no interval"
        self._train_time_interval = timedelta(microseconds=1) if due else None
        if due and self._last_time_checked is None:
            self._last_time_checked = time.monotonic()

    def _ckptdb_preemption_checkpoint(
        self, trainer: pl.Trainer, session: _Session, stop: Preemption, step: int
    ) -> list[Checkpoint]:
        """The agreed step's checkpoint (collective); empty when it was refused or abandoned."""
        done = [
            c
            for c in (session.ledger.manager.latest(s) for s in self.streams())
            if c is not None and c.step == step and c.id in self._ckptdb_published
        ]
        if done:
            stop.already_saved(step)
            return done
        candidates = self.monitor_candidates(trainer)
        filepath = self.ckptdb_free_filepath(candidates, trainer)
        record = stop.publish(
            step,
            lambda: self._ckptdb_publish(trainer, self.last_stream, filepath, candidates, None),
        )
        if record is None:
            return []
        try:  # rank 0 writes the alias: its failure must not split the ranks' ending
            self.ckptdb_save_last(trainer, candidates, target=record)
        except OSError as exc:
            log.error("ckptdb: last was not pointed at the preemption checkpoint: %s", exc)
        return [record]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's ``load_state_dict``: its restore, then the ledger's word.

        The state inside a checkpoint is one checkpoint stale; once the
        callback is set up, ``best_k_models``, ``best_model_path`` and the
        other top-k attributes are replaced by the ledger's committed top-k,
        so none names a checkpoint the ledger no longer has. Outside a
        Trainer (no ledger open) it restores exactly what Lightning would.

        Args:
            state_dict: The callback's state, as ``state_dict`` saved it.
        """
        super().load_state_dict(state_dict)
        key = self._ckptdb_session_key
        session = _SESSIONS.get(key) if key is not None else None
        if session is not None:
            self._ckptdb_sync(session)
            if self.last_model_path and not self.save_last:
                self.last_model_path = ""

    def ckptdb_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """What ``ckpt_path="last"`` resolves to: the newest committed, whole checkpoint.

        Called by Lightning (its private ``_find_last_checkpoints``) before any
        process group exists, on every rank. Never a file chosen by its
        modification time, and read-only (see ``newest_committed``). With
        ``remote=``, in ``fit`` on one process, the run is first opened once
        with its copy: a newest checkpoint missing or corrupt here is brought
        back from it (that open is one more attempt in the ledger).

        Args:
            trainer: The Trainer resolving ``ckpt_path``.

        Returns:
            The path of that checkpoint, or an empty set when there is none.

        Raises:
            InvalidArgumentError: The resolved ``dirpath`` is a URL.
            LedgerLockedError: With ``remote=``, another process trains into the
                run.
        """
        root, db_url = self._ckptdb_key(trainer)
        if self.remote is not None and trainer.state.fn == TrainerFn.FITTING:
            # validate/test/predict read only: they never take the writer lock
            self._ckptdb_restore_newest(trainer, root, db_url)
        newest = newest_committed(root, db_url=db_url)
        return {str(newest.path)} if newest is not None else set()

    def _ckptdb_restore_newest(self, trainer: pl.Trainer, root: str, db_url: str | None) -> None:
        """Bring the newest checkpoint back from its copy before Lightning looks.

        Lightning resolves ``"last"`` before any process group exists and keeps
        only candidates that exist on disk, so a restore at the ledger's open
        (in :meth:`setup`) would come too late. In one process the run is opened
        here once, with ``remote=``: the open restores what a new machine lacks,
        and the newest checkpoint is verified, a corrupt one brought back from
        its copy (an older one is tried when it has none). Ranks resolving at
        once could not agree on who restores: on several, nothing is restored
        here (said in a warning); restore before the job (``ckptdb restore``).
        """
        if trainer.world_size > 1:
            log.warning(
                'ckptdb: fit(ckpt_path="last") on %d processes resolves before the ranks can '
                "agree: nothing was restored from %s; run `ckptdb restore` before the job",
                trainer.world_size,
                self.remote,
            )
            return
        if not common.run_recorded(Path(root), db_url) and not common.ledger_copied(
            Path(root), db_url, self.remote, self.remote_options
        ):
            return  # a first run: nothing to restore
        dirpath = Path(self.resolved_dirpath(trainer)).resolve()
        with CheckpointManager(
            root,
            save_dir=dirpath,
            db_url=db_url,
            remote=self.remote,
            remote_options=self.remote_options,
        ) as manager:
            found = manager.checkpoints()
            for record in sorted(found, key=lambda c: (c.committed_at, c.id), reverse=True):
                try:
                    manager.verify(record)
                    return
                except (CorruptCheckpointError, CheckpointLostError) as exc:
                    log.warning("ckptdb: not resuming from %s: %s", record.path, exc)

    # ------------------------------------------------------------------ saving

    def ckptdb_save_monitored(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]
    ) -> None:
        """A save of a monitored callback: the ledger decides admission to the top-k.

        Lightning's private ``_save_monitor_checkpoint`` and
        ``_update_best_and_save`` come here (collective: every rank). The
        checkpoint is one boundary of the top-k stream, ranked by the monitor
        (a NaN score ranks worst); the ledger's answer is shared with every
        rank and sets the top-k attributes. ``current_score`` is the score of
        the last checkpoint saved, as in Lightning: set before the write (the
        state inside the file holds it), put back when the candidate was not
        admitted. Nothing is saved when the monitor is not among the metrics.

        Args:
            trainer: The Trainer that is saving.
            monitor_candidates: The metrics Lightning has at this point (the
                monitor's value among them).

        Raises:
            NonFiniteGradientError: With ``guard="raise"``, a non-finite
                gradient since the previous checkpoint.
            PublishError: The save failed on some rank; nothing was published
                and the attributes are as they were.
        """
        assert self.monitor is not None
        current = monitor_candidates.get(self.monitor)
        if current is None:
            return
        score = _score(current, self.mode)
        filepath = self.ckptdb_free_filepath(monitor_candidates, trainer)
        before = {**self._ckptdb_bookkeeping(), "current_score": self.current_score}
        self.current_score = score
        self._ckptdb_expect(filepath, score)  # the state inside the file includes the file itself
        try:
            record = self._ckptdb_publish(
                trainer, self.main_stream, filepath, monitor_candidates, score
            )
        except BaseException:
            self._ckptdb_restore(before)
            raise
        if record is None:
            self.current_score = before["current_score"]
            if self.verbose:
                log.info(
                    "step %d: %r was not in top %d",
                    trainer.global_step,
                    self.monitor,
                    self.save_top_k,
                )

    def ckptdb_save_unmonitored(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]
    ) -> None:
        """A save of a callback without a monitor: one boundary of its ``Keep`` stream.

        Lightning's private ``_save_none_monitor_checkpoint`` comes here
        (collective). The newest ``save_top_k`` checkpoints stay; the ledger
        evicts older ones after the commit. ``best_model_path`` names the
        newest committed checkpoint, as in Lightning.

        Args:
            trainer: The Trainer that is saving.
            monitor_candidates: The metrics Lightning has at this point (for the
                file name and the row).

        Raises:
            NonFiniteGradientError: With ``guard="raise"``, a non-finite
                gradient since the previous checkpoint.
            PublishError: The save failed on some rank; nothing was published.
        """
        filepath = self.ckptdb_free_filepath(monitor_candidates, trainer)
        # the state saved inside the checkpoint names the checkpoint itself, as in Lightning
        previous, self.best_model_path = self.best_model_path, filepath
        try:
            published = self._ckptdb_publish(
                trainer, self.main_stream, filepath, monitor_candidates, None
            )
        except BaseException:
            self.best_model_path = previous
            raise
        if published is None:
            self.best_model_path = previous

    def ckptdb_save_other(self, trainer: pl.Trainer, filepath: str) -> None:
        """Any other save Lightning asks for: one boundary of the ``last`` stream.

        Lightning's private ``_save_checkpoint`` comes here (collective). The
        checkpoint is published under ``filepath``, or a ``-vN`` version of it
        when that name is taken.

        Args:
            trainer: The Trainer that is saving.
            filepath: The path Lightning chose, inside ``dirpath``.

        Raises:
            InvalidArgumentError: ``filepath`` is outside ``dirpath``.
            NonFiniteGradientError: With ``guard="raise"``, a non-finite
                gradient since the previous checkpoint.
            PublishError: The save failed on some rank; nothing was published.
        """
        candidates = self.monitor_candidates(trainer)
        if self.file_exists(filepath, trainer):
            filepath = self.ckptdb_free_filepath(candidates, trainer)
        self._ckptdb_publish(trainer, self.last_stream, filepath, candidates, None)

    def ckptdb_save_last(
        self,
        trainer: pl.Trainer,
        monitor_candidates: dict[str, Tensor],
        target: Checkpoint | None = None,
    ) -> None:
        """Point the ``last`` alias at the newest committed checkpoint, writing one if needed.

        Lightning's private ``_save_last_checkpoint`` comes here (collective).
        With ``save_last="link"`` the alias names the newest top-k checkpoint;
        otherwise the checkpoint committed at this step, and when none was (for
        instance ``save_top_k=0``) one is written as ``last-step=<step>.ckpt``
        into the ``<stream>.last`` stream. Rank 0 then makes ``last.ckpt`` a
        hard link to it, under a temporary name renamed over the old one.
        Nothing happens without ``save_last`` or at a step the guard refused.

        Args:
            trainer: The Trainer that is saving.
            monitor_candidates: The metrics Lightning has at this point (for the
                alias's file name and the row).
            target: The checkpoint to point at, whatever ``save_last`` prefers
                (the preemption checkpoint); None: decide as above.

        Raises:
            NonFiniteGradientError: With ``guard="raise"``, a non-finite
                gradient since the previous checkpoint, when one is written.
            PublishError: Writing the ``last`` checkpoint failed on some rank.
        """
        if not self.save_last:
            return
        session = self._ckptdb_session(trainer)
        if session.refused_step == trainer.global_step:
            return
        alias = self._ckptdb_alias_path(monitor_candidates, trainer)
        previous, self.last_model_path = self.last_model_path, alias
        try:
            if target is None:
                target = self._ckptdb_last_target(session, trainer.global_step)
            if target is None:
                own = Path(alias)
                backing = own.with_name(f"{own.stem}-step={trainer.global_step}{own.suffix}")
                target = self._ckptdb_publish(
                    trainer, self.last_stream, str(backing), monitor_candidates, None
                )
        except BaseException:
            self.last_model_path = previous
            raise
        if target is None:  # refused: last still names what it named
            self.last_model_path = previous
            return
        if not trainer.is_global_zero:
            return
        point_alias(target.path, Path(alias))
        if previous and previous != alias and self.alias_replaced(trainer, previous, alias):
            remove_alias(Path(previous))

    def _ckptdb_last_target(self, session: _Session, step: int | None) -> Checkpoint | None:
        """What ``last`` names.

        At a save (``step`` given), only what this fit committed counts, as in
        Lightning (a rerun never links ``last`` to an earlier run's file): with
        ``"link"``, the newest top-k checkpoint; otherwise the checkpoint this
        callback committed at ``step``. On resume (``step`` None): the newest
        committed checkpoint of this callback's streams.
        """
        manager = session.ledger.manager
        main = manager.latest(self.main_stream) if self.save_top_k != 0 else None
        last = manager.latest(self.last_stream)
        if step is not None:
            main, last = (
                c if c is not None and c.id in self._ckptdb_published else None
                for c in (main, last)
            )
        if self.save_last == "link" and main is not None:
            return main
        own = [c for c in (main, last) if c is not None]
        newest = max(own, key=lambda c: (c.committed_at, c.id), default=None)
        if newest is None or (step is not None and newest.step != step):
            return None
        return newest

    def ckptdb_free_filepath(
        self, monitor_candidates: dict[str, Tensor], trainer: pl.Trainer
    ) -> str:
        """Lightning's name for the next checkpoint, with a ``-vN`` suffix whenever it is taken.

        Lightning's private ``_get_metric_interpolated_filepath_name`` comes
        here. Lightning may reuse the name of the file it is about to delete
        (or, with ``enable_version_counter=False``, overwrite any); ckptdb never
        publishes over a checkpoint, so a taken name always gets a version:
        taken on disk, or by a live row of the ledger (a lost checkpoint's
        name stays its own).

        Args:
            monitor_candidates: The metrics the ``filename`` template is
                formatted from.
            trainer: The Trainer that is saving.

        Returns:
            The path to save to, inside ``dirpath``.
        """
        filepath = self.format_checkpoint_name(monitor_candidates)
        version = self.STARTING_VERSION
        while self.file_exists(filepath, trainer) or self._ckptdb_held(filepath):
            filepath = self.format_checkpoint_name(monitor_candidates, ver=version)
            version += 1
        return filepath

    def _ckptdb_held(self, filepath: str) -> bool:
        """Whether a live row owns the name (a lost checkpoint's too): never written again."""
        key = self._ckptdb_session_key
        session = _SESSIONS.get(key) if key is not None else None
        return session is not None and session.ledger.holds(self._ckptdb_name_in_dirpath(filepath))

    def _ckptdb_alias_path(self, monitor_candidates: dict[str, Tensor], trainer: pl.Trainer) -> str:
        filepath = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        if self.version_counter_enabled:
            version = self.STARTING_VERSION
            while self.file_exists(filepath, trainer) and filepath != self.last_model_path:
                filepath = self.format_checkpoint_name(
                    monitor_candidates, self.CHECKPOINT_NAME_LAST, ver=version
                )
                version += 1
        return filepath

    def _ckptdb_publish(
        self,
        trainer: pl.Trainer,
        stream: str,
        filepath: str,
        monitor_candidates: dict[str, Tensor],
        score: Tensor | None,
    ) -> Checkpoint | None:
        """One boundary: Lightning writes ``filepath`` through the ledger; None if not published.

        The bookkeeping set for the write (:meth:`_expect`) is replaced by the
        ledger's outcome afterwards, whatever happened: a refused or failed
        save never leaves a path behind that was not committed.
        """
        session = self._ckptdb_session(trainer)
        step = trainer.global_step
        before = self._ckptdb_bookkeeping(exclude_best=score is None)
        if session.refused_step == step:
            self._ckptdb_restore(before)
            return None
        name = self._ckptdb_name_in_dirpath(filepath)
        weights_only = self.save_weights_only

        def write(path: Path) -> FileInfo | None:
            return _save_checkpoint(trainer, path, weights_only)

        metrics = common.rankable_metrics(
            self._ckptdb_boundary_metrics(monitor_candidates, score),
            session.ledger.manager.policies.get(stream),
            step=step,
            log=log,
        )

        def refused(exc: NonFiniteGradientError) -> None:
            session.refused_step = step
            self._ckptdb_sync(session)  # the refusal is agreed by every rank: the query is too

        try:
            record = session.ledger.publish(
                step, stream, External(write, name), metrics=metrics, log=log, refused=refused
            )
        except NonFiniteGradientError:
            raise
        except BaseException:
            self._ckptdb_restore(before)  # no collective here: a rank may be failing alone
            raise
        if session.refused_step == step:
            return None
        if record is not None:
            self._ckptdb_published.add(record.id)
            self.note_saved(step, str(record.path))
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.after_save_checkpoint(proxy(self))
        self._ckptdb_sync(session)
        return record

    def _ckptdb_boundary_metrics(
        self, candidates: dict[str, Tensor], score: Tensor | None
    ) -> dict[str, float]:
        """The scalar metrics Lightning has at this boundary (with the score as ranked)."""
        metrics = dict(common.scalars(candidates))
        if self.monitor is not None and score is not None:
            metrics[self.monitor] = float(score.item())
        return metrics

    def _ckptdb_name_in_dirpath(self, filepath: str) -> str:
        assert self.dirpath is not None
        dirpath = Path(self.dirpath).resolve()
        target = Path(filepath)
        target = target if target.is_absolute() else dirpath / target
        try:
            return target.resolve().relative_to(dirpath).as_posix()
        except ValueError:
            raise InvalidArgumentError(
                f"{filepath} is outside dirpath {dirpath}; the ckptdb ModelCheckpoint only "
                "publishes inside it"
            ) from None

    def _ckptdb_bookkeeping(self, exclude_best: bool = False) -> dict[str, Any]:
        """Lightning's top-k attributes, to put back when a save does not happen."""
        names = ["best_k_models", "best_model_score", "kth_best_model_path", "kth_value"]
        if not exclude_best:
            names.append("best_model_path")
        return {name: getattr(self, name) for name in names}

    def _ckptdb_restore(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def _ckptdb_expect(self, filepath: str, score: Tensor) -> None:
        """Lightning's bookkeeping as it will be if ``filepath`` enters the top-k.

        Set before the write (Lightning's order), so the state saved inside
        the checkpoint names it; the ledger's outcome replaces it right after
        the commit (or the refusal).
        """
        ranked = sorted(
            [*self.best_k_models.items(), (filepath, score)],
            key=lambda item: float(item[1]),
            reverse=self.mode == "max",
        )
        kept = ranked if self.save_top_k == -1 else ranked[: self.save_top_k]
        if filepath not in dict(kept):
            return
        self.best_k_models = dict(kept)
        self.best_model_path, self.best_model_score = kept[0][0], kept[0][1]
        if self.save_top_k == -1 or len(kept) == self.save_top_k:
            self.kth_best_model_path, self.kth_value = kept[-1][0], kept[-1][1]

    def _ckptdb_sync(self, session: _Session) -> None:
        """Lightning's top-k bookkeeping, as the ledger says (committed checkpoints only)."""
        if self.save_top_k == 0:
            return
        manager = session.ledger.manager
        if self.monitor is None:
            latest = manager.latest(self.main_stream)
            self.best_model_path = str(latest.path) if latest is not None else ""
            return
        members = manager.best(self.main_stream)
        self.best_k_models = {str(c.path): _tensor(c.metric) for c in members}
        if not members:
            self.best_model_path, self.best_model_score = "", None
            self.kth_best_model_path = ""
            return
        self.best_model_path = str(members[0].path)
        self.best_model_score = _tensor(members[0].metric)
        if self.save_top_k == -1 or len(members) == self.save_top_k:
            self.kth_best_model_path = str(members[-1].path)
            self.kth_value = _tensor(members[-1].metric)


def _score(current: Tensor, mode: str) -> Tensor:
    """Lightning's score: NaN ranks worst (``inf`` for ``min``, ``-inf`` for ``max``)."""
    if isinstance(current, Tensor) and torch.isnan(current):
        return torch.tensor(math.inf if mode == "min" else -math.inf, device=current.device)
    return current if isinstance(current, Tensor) else torch.tensor(float(current))


def _tensor(metric: float | None) -> Tensor:
    value = 0.0 if metric is None else metric
    if abs(value) == sys.float_info.max:
        value = math.copysign(math.inf, value)
    return torch.tensor(value)


def _save_checkpoint(trainer: pl.Trainer, path: Path, weights_only: bool) -> FileInfo | None:
    """``trainer.save_checkpoint(path)``, as its parts, so that no rank is left waiting.

    With a strategy that writes one file on rank 0 (single device, DDP: they
    keep ``Strategy.save_checkpoint``), the checkpoint is dumped as Lightning
    dumps it and rank 0 writes it; the barrier that ends Lightning's save is
    reached even when the write failed, so every rank gets to ckptdb's
    agreement on the outcome instead of hanging. The stock
    ``TorchCheckpointIO`` is replaced by a direct ``torch.save`` into the file,
    hashed and fsynced as the bytes stream out (the stock IO serializes into
    memory first, then copies); another ``CheckpointIO`` writes as it would.
    Strategies with a save of their own (FSDP, DeepSpeed, ModelParallel: every
    rank writes its shards, with their own agreement) run Lightning's
    ``save_checkpoint`` and ckptdb seals what they wrote.
    """
    strategy = trainer.strategy
    if type(strategy).save_checkpoint is not Strategy.save_checkpoint or trainer.model is None:
        trainer.save_checkpoint(path, weights_only)
        return None
    info = None
    io = strategy.checkpoint_io
    with trainer.profiler.profile("save_checkpoint"):  # type: ignore[attr-defined]
        try:
            checkpoint = dump_checkpoint(trainer, weights_only)
            if trainer.is_global_zero:
                if type(io) is TorchCheckpointIO:
                    info = write_stream(lambda f: torch.save(checkpoint, f), path)
                else:
                    io.save_checkpoint(checkpoint, path)
        finally:  # a rank that failed still meets the others; ckptdb agrees on the outcome
            strategy.barrier("Trainer.save_checkpoint")
    return info
