"""The one contract between the ledger and a framework integration.

Every integration (Lightning, the Hugging Face Trainer, Accelerate,
DeePMD-kit) takes the same ledger options and does the same few things with
the ledger around a framework's own writer. Both are written here once:

- :class:`LedgerOptions`: the options every integration accepts (``db_url``,
  ``guard``, ``remote``, ``remote_options``, ``preemption``), frozen and
  validated when it is made, with one wording per refusal;
- :class:`IntegrationLedger`: the object an integration holds while its
  framework trains. It opens the run, and offers what only integrations
  need: a boundary of a framework-written payload (:meth:`~IntegrationLedger.publish_all`),
  the resume source (:meth:`~IntegrationLedger.newest_whole`,
  :meth:`~IntegrationLedger.resume_from`, :meth:`~IntegrationLedger.start_afresh`),
  rank agreement (:meth:`~IntegrationLedger.agree`, :meth:`~IntegrationLedger.from_chief`),
  free names (:meth:`~IntegrationLedger.free_name`), protection, and a close
  that says how training ended (:meth:`~IntegrationLedger.close`).

:class:`~ckptdb.CheckpointManager` keeps the surface of a training loop and of
maintenance; what an integration reads (latest, best, verify, metrics) it
reads through :attr:`IntegrationLedger.manager`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from ..errors import (
    ArgumentTypeError,
    CheckpointLostError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NonFiniteGradientError,
)
from ..guard import NonFiniteGradGuard
from ..interval import AUTO, IntervalSetting, interval_of
from ..ledger import models as m
from ..ledger.engine import safe_url
from ..manager import CheckpointManager
from ..policies import Policy
from ..preemption import OnPreemption, Preemption, on_preemption
from ..record import Checkpoint
from ..storage.external import External
from .common import GuardSetting, check_db_url, check_guard, check_remote

T = TypeVar("T")

#: States of a row whose checkpoint was committed once and is no longer usable.
_SPOILED = (m.LOST, m.CORRUPT)

#: What each state of a row that is not committed means, for the user.
_WHY_NOT = {
    m.PENDING: "it is being written (a save in progress)",
    m.ABORTED: "its save never completed (a partial save, rolled back)",
    m.DELETING: "retention removed it (its files are being deleted)",
    m.DELETED: "retention removed it",
    m.LOST: "its files are gone (marked lost)",
    m.CORRUPT: (
        "its files no longer match its ledger row (size or hash differs: they were "
        "rewritten or damaged after the commit; marked corrupt)"
    ),
}


@dataclass(frozen=True)
class LedgerOptions:
    """The ledger options every integration takes, checked once, the same way.

    - ``db_url``: a SQLAlchemy URL of the ledger (None: SQLite in the run root);
    - ``guard``: ``True`` (a non-finite gradient refuses the step's checkpoint,
      training goes on), ``"raise"`` (it stops training) or ``False``;
    - ``remote``/``remote_options``: where a replicator copies the run; a
      resume whose checkpoint is missing or corrupt here brings its copy back;
    - ``preemption``: an :class:`~ckptdb.OnPreemption` (or None). Build with
      :meth:`of` to pass ``True``/``False`` as the integrations' arguments do;
    - ``interval``: when to checkpoint, seconds or ``"auto"`` within bounds
      (:class:`~ckptdb.interval.IntervalSetting`, or None: the framework's own
      schedule); each framework exposes it in its own idiom.

    Raises:
        InvalidArgumentError: a value outside what the option accepts.
        ArgumentTypeError: a value of the wrong type.
    """

    db_url: str | None = None
    guard: GuardSetting = True
    remote: str | None = None
    remote_options: Mapping[str, object] | None = None
    preemption: OnPreemption | None = None
    interval: IntervalSetting | None = None

    def __post_init__(self) -> None:
        check_db_url(self.db_url)
        check_guard(self.guard)
        check_remote(self.remote)
        if self.remote_options is not None:
            if not isinstance(self.remote_options, Mapping):
                raise ArgumentTypeError(  # its values may be credentials: the type only
                    f"remote_options must be a mapping, got a {type(self.remote_options).__name__}"
                )
            if self.remote is None:
                raise InvalidArgumentError("remote_options= goes with remote=")
            # a read-only copy: a caller's later change to its dict changes nothing here
            # (values inside are the caller's, as given)
            object.__setattr__(self, "remote_options", MappingProxyType(dict(self.remote_options)))
        if self.interval is not None and not isinstance(self.interval, IntervalSetting):
            raise ArgumentTypeError(
                f"interval must be an IntervalSetting (LedgerOptions.of takes seconds or "
                f"'auto'), got {self.interval!r}"
            )
        if self.preemption is not None and not isinstance(self.preemption, OnPreemption):
            raise ArgumentTypeError(
                f"preemption must be an OnPreemption (LedgerOptions.of takes True/False), "
                f"got {self.preemption!r}"
            )

    @classmethod
    def of(
        cls,
        *,
        db_url: object = None,
        guard: object = True,
        remote: object = None,
        remote_options: object = None,
        preemption: object = None,
        interval: object = None,
        min_interval: object = None,
        max_interval: object = None,
    ) -> LedgerOptions:
        """The options as an integration's keyword arguments give them (``preemption``
        may be ``True``, ``False``, None or an :class:`~ckptdb.OnPreemption`;
        ``interval`` seconds, ``"auto"`` or None, within ``min_interval`` and
        ``max_interval`` seconds).

        Raises:
            InvalidArgumentError: a value outside what the option accepts.
            ArgumentTypeError: a value of the wrong type.
        """
        return cls(
            db_url=check_db_url(db_url),
            guard=check_guard(guard),
            remote=check_remote(remote),
            remote_options=remote_options,  # type: ignore[arg-type]  # checked in __post_init__
            preemption=on_preemption(preemption),
            interval=interval_of(interval, min_interval, max_interval),
        )

    def __reduce__(self) -> tuple[type[LedgerOptions], tuple[object, ...]]:
        """Picklable (a read-only mapping is not): frameworks pickle their callbacks to
        start other processes."""
        options = dict(self.remote_options) if self.remote_options is not None else None
        return (
            type(self),
            (self.db_url, self.guard, self.remote, options, self.preemption, self.interval),
        )

    def __repr__(self) -> str:
        """Without secrets: the ledger URL's password hidden, ``remote_options`` by key
        (they hold credentials), so the options can be logged."""
        url = safe_url(self.db_url) if self.db_url is not None else None
        keys = sorted(self.remote_options) if self.remote_options is not None else None
        return (
            f"LedgerOptions(db_url={url!r}, guard={self.guard!r}, remote={self.remote!r}, "
            f"remote_options={'keys ' + repr(keys) if keys is not None else None}, "
            f"preemption={self.preemption!r}, interval={self.interval!r})"
        )

    def __hash__(self) -> int:
        keys = tuple(sorted(self.remote_options)) if self.remote_options is not None else None
        return hash((self.db_url, self.guard, self.remote, keys, self.preemption, self.interval))

    def remote_key(self) -> str:
        """A comparable text of ``remote``/``remote_options``, whatever the order of the
        options' keys (peers sharing a run must agree on it)."""
        options = sorted(self.remote_options.items()) if self.remote_options is not None else None
        return repr((self.remote, options))


def _pacing(setting: IntervalSetting | None) -> dict[str, Any]:
    """The manager's ``interval``/``min_interval``/``max_interval`` for ``setting``."""
    if setting is None:
        return {}
    interval: float | str = AUTO if setting.fixed is None else setting.fixed
    return {"interval": interval, "min_interval": setting.low, "max_interval": setting.high}


class IntegrationLedger:
    """What an integration holds while its framework trains: one open run.

    Every rank opens one (:meth:`open`, collective under torch.distributed,
    as :class:`~ckptdb.CheckpointManager`); only the chief opens the ledger.
    A manager opened otherwise (a maintenance tool's) can be wrapped as it is.
    Used as a context manager, leaving it by an exception ends the attempt
    as failed.
    """

    def __init__(self, manager: CheckpointManager, options: LedgerOptions) -> None:
        if not isinstance(manager, CheckpointManager):
            raise ArgumentTypeError(
                f"manager must be a CheckpointManager, got a {type(manager).__name__}"
            )
        if not isinstance(options, LedgerOptions):
            raise ArgumentTypeError(
                f"options must be a LedgerOptions, got a {type(options).__name__}"
            )
        #: The training-loop surface (latest, best, verify, log_metrics, derive_aliases).
        self.manager = manager
        self.options = options

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        options: LedgerOptions,
        *,
        streams: dict[str, Policy] | None = None,
        save_dir: str | os.PathLike[str] | None = None,
        guard: NonFiniteGradGuard | None = None,
    ) -> IntegrationLedger:
        """Open the run at ``root`` for training (the writer lock, an attempt, a reconcile).

        Raises:
            CkptDBError: whatever opening the run raises (a locked run, an
                unreachable ledger, a bad ``save_dir``): nothing is left open.
        """
        if not isinstance(options, LedgerOptions):
            raise ArgumentTypeError(
                f"options must be a LedgerOptions, got a {type(options).__name__}"
            )
        manager = CheckpointManager(
            root,
            streams=streams,
            save_dir=save_dir,
            db_url=options.db_url,
            guard=guard,
            remote=options.remote,
            remote_options=options.remote_options,
            **_pacing(options.interval),
        )
        return cls(manager, options)

    def __enter__(self) -> IntegrationLedger:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)

    @property
    def save_dir(self) -> Path:
        return self.manager.save_dir

    @property
    def is_chief(self) -> bool:
        """Whether this rank writes the framework's derived files (aliases, pointers)."""
        return self.manager.is_chief

    # ------------------------------------------------------------------ lifecycle

    def close(self, failed: BaseException | None = None) -> None:
        """End the attempt (``failed`` when training raised ``failed``) and release the run.

        Raises:
            PublishError: a boundary still in flight failed and nobody fetched
                its error (only when ``failed`` is None: it is logged otherwise).
        """
        self.manager._close("closed" if failed is None else "failed")

    def due(self, step: int) -> bool:
        """Whether to checkpoint at ``step`` (``options.interval``); the same answer on
        every rank at the same call. Reports the step for goodput too.

        Raises:
            InvalidArgumentError: the options have no interval.
        """
        return self.manager.due(step)

    def heartbeat(self, step: int) -> None:
        """Report that training finished ``step`` (goodput), where the framework's own
        schedule decides when to checkpoint."""
        self.manager.heartbeat(step)

    def preemption(self) -> Preemption | None:
        """The preemption handlers ``options.preemption`` asks for (collective), else None."""
        settings = self.options.preemption
        if settings is None:
            return None
        return self.manager.preemption(
            signals=settings.signals, grace=settings.grace, every=settings.every
        )

    # --------------------------------------------------------------------- publish

    def publish(
        self,
        step: int,
        stream: str,
        payload: External,
        *,
        metrics: Mapping[str, float] | None,
        log: logging.Logger,
        refused: Callable[[NonFiniteGradientError], None] | None = None,
    ) -> Checkpoint | None:
        """One boundary of ``payload`` into ``stream``: the committed checkpoint, or None
        (the guard refused the step, or a top-K stream did not admit it); see
        :meth:`publish_all`."""
        saved = self.publish_all(step, {stream: payload}, metrics=metrics, log=log, refused=refused)
        return saved.get(stream) if saved is not None else None

    def publish_all(
        self,
        step: int,
        payloads: Mapping[str, External],
        *,
        metrics: Mapping[str, float] | None,
        log: logging.Logger,
        refused: Callable[[NonFiniteGradientError], None] | None = None,
    ) -> dict[str, Checkpoint] | None:
        """One boundary of several streams' payloads: the committed checkpoints by stream
        (every one, or none), or None when the guard refused the step.

        A refusal is the same for every framework: the manager has recorded the
        ``guard_tripped`` event; ``refused(error)`` (when given) lets the
        integration note it; then ``guard="raise"`` re-raises it, and otherwise
        a warning is logged and training goes on.

        Raises:
            NonFiniteGradientError: the guard tripped and ``guard="raise"``.
            PublishError: the boundary failed; the ledger is as it was.
        """
        try:
            return self.manager.save(step, metrics=metrics, blocking=True, **payloads)
        except NonFiniteGradientError as exc:
            if refused is not None:
                refused(exc)
            if self.options.guard == "raise":
                raise
            log.warning("ckptdb: step %d was not checkpointed: %s", step, exc)
            return None

    # ---------------------------------------------------------------------- names

    def free_name(self, base: str, directory: Path | None = None, *, suffix: str = "") -> str:
        """``base``, or ``base-v<n>`` (n = 1, 2, ...) when that name is taken; with a
        ``suffix`` that ``base`` ends in, the version goes before it
        (``model.ckpt-100-v1.pt``: tools that find checkpoints by suffix still do).

        Taken by a live row (a re-saved step, a checkpoint of an abandoned
        timeline, a lost one) or by anything on disk in ``directory`` (default:
        the save directory): ckptdb never publishes over a name, and a rerun in
        the same directory must not fail. Collective: one question to the chief
        per name tried.
        """
        where = self.save_dir if directory is None else directory
        cut = suffix and base.endswith(suffix)
        stem, end = (base[: -len(suffix)], suffix) if cut else (base, "")
        name, version = base, 0
        while self.holds(name) or os.path.lexists(where / name):
            version += 1
            name = f"{stem}-v{version}{end}"
        return name

    def holds(self, name: str) -> bool:
        """Whether a live row owns ``name`` (relative to the save directory): pending,
        committed, being deleted, lost or corrupt. Collective (the chief answers)."""
        return self.manager._holds(name)

    # ------------------------------------------------------------------- resuming

    def newest_whole(self, stream: str, log: logging.Logger) -> Checkpoint | None:
        """The newest committed checkpoint of ``stream`` whose size and hash match its row.

        A mismatch is marked ``corrupt`` or ``lost`` (latest moves back), and the
        next older one is tried. Collective: the chief checks, every rank gets
        the answer.
        """
        while True:
            try:
                return self.manager.verify("latest", stream=stream)
            except (CorruptCheckpointError, CheckpointLostError) as exc:
                log.warning("ckptdb: not resuming from it: %s", exc)
            except CheckpointNotFoundError:
                return None

    def resume_from(self, checkpoint: Checkpoint) -> None:
        """Training resumes from ``checkpoint`` (which the framework loads itself): it is
        protected while the run is open, and the resume recorded (a ``resumed`` event,
        the attempt's ``resumed_from_id``)."""
        self.protect(checkpoint)
        self.manager._resumed_from(checkpoint)

    def start_afresh(self, stream: str | None = None) -> None:
        """Training starts afresh where checkpoints already are (a rerun): they are all
        protected; the new timeline evicts them from the stream when retention says so,
        but their files stay on disk, as the frameworks leave them."""
        for record in self.manager.checkpoints(stream):
            self.protect(record)

    def protect(self, checkpoint: Checkpoint) -> None:
        """Never remove ``checkpoint``'s file while this run is open (retention still
        takes it out of its stream; the file then stays, no longer ckptdb's)."""
        self.manager.protect(checkpoint)

    def committed_at(self, stream: str, step: int | None) -> Checkpoint | None:
        """The newest committed checkpoint of ``stream`` at ``step``, if any (one indexed
        query; None for no step). Collective whatever ``step`` is: the chief's question
        is answered on every rank."""
        return self.manager._committed_at(stream, step)

    def spoiled_at(self, stream: str, step: int | None) -> list[Checkpoint]:
        """The checkpoints of ``stream`` at ``step`` that were committed and have since
        been found lost or corrupt (none for no step). Collective whatever ``step`` is."""
        found = self.manager.checkpoints(stream, states=_SPOILED)
        return [c for c in found if step is not None and c.step == step]

    def on_this_timeline(self, checkpoint: Checkpoint, resumed: Checkpoint | None) -> bool:
        """Whether ``checkpoint`` belongs to the timeline this attempt continues: saved by
        this attempt, or at or before the step it resumed from (an earlier run's or an
        abandoned branch's checkpoint at a later step is not this run's)."""
        if checkpoint.attempt_id == self.manager.attempt_id:
            return True
        return resumed is not None and checkpoint.step <= resumed.step

    def why_not(self, path: Path) -> str:
        """Why ``path`` (inside the save directory) names no committed checkpoint, as the
        ledger knows it: for the error a framework's resume argument gets."""
        rel = os.path.relpath(path, self.save_dir)
        found = self.manager._newest_row_at(rel)
        if found is None:
            return "the ledger has no record of it (not written by this run)"
        state, error = found
        reason = _WHY_NOT.get(state, f"its row is {state}")
        return f"{reason} ({error})" if error and state != m.DELETED else reason

    # ------------------------------------------------------------ rank agreement

    def agree(self, local: BaseException | None, *, what: str = "agree") -> None:
        """Raise on every rank if any rank failed a local step of its own; collective.

        Every rank calls it, whatever happened locally: the rank that failed
        raises ``local`` itself; every other rank raises
        :class:`~ckptdb.errors.RankFailedError` naming the failed ranks. In one
        process ``local`` is raised as itself.

        Raises:
            RankFailedError: another rank failed.
        """
        self.manager._agree(local, what=what)

    def from_chief(self, value: T, *, what: str = "share") -> T:
        """The chief's ``value`` (picklable), on every rank; collective. For frameworks
        that decide on rank 0 alone what the next boundary is."""
        return self.manager._from_chief(value, what=what)

    def __repr__(self) -> str:
        return f"IntegrationLedger({self.manager.root}, {self.options!r})"
