"""``dp --pt train`` / ``dp --pt-expt train`` through a ckptdb ledger (see the
package docstring): the command line, and the ``--pt`` backend's trainer.

It drives DeePMD's ``Trainer`` (its checkpoint writer, its stores, its
guard) through :mod:`.compat`, the one module that imports DeePMD-kit and
holds every private name borrowed from it; importing this module imports
:mod:`.compat`, which refuses any DeePMD-kit but the tested 3.2 series
(:func:`check_version`) before DeePMD's internals are imported. What both
backends share is :mod:`.session`; the ``--pt-expt`` trainer is
:mod:`.train_expt`.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from ...errors import InvalidArgumentError
from ...preemption import OnPreemption
from .. import common
from ..contract import LedgerOptions
from . import compat  # checks DeePMD-kit's version before importing any of its internals
from .compat import SUPPORTED, SUPPORTED_RANGE, check_version
from .layout import EMA_STREAM, STREAM
from .logs import LogTail
from .session import (
    INTERVAL_OPTION,
    PREEMPTION_OPTION,
    LedgerTraining,
    Options,
    Writer,
    resolve_restart,
)

__all__ = [
    "SUPPORTED",
    "SUPPORTED_RANGE",
    "ExptLedgerTrainer",
    "LedgerTrainer",
    "LogTail",
    "Options",
    "check_version",
    "main",
    "resolve_restart",
]

log = logging.getLogger("ckptdb.deepmd")

#: ckptdb's own option (taken out of the argument list before DeePMD parses it).
GUARD_OPTION = "--ckptdb-guard"
GUARD_CHOICES: dict[str, common.GuardSetting] = {"warn": True, "raise": "raise", "off": False}
#: The grace period of ``--ckptdb-preemption``.
GRACE_OPTION = "--ckptdb-grace"
#: Where a replicator copies the run (``s3://bucket/prefix``): see CheckpointManager(remote=).
REMOTE_OPTION = "--ckptdb-remote"
#: The ledger's URL (PostgreSQL for several machines); default: ``CKPTDB_DB_URL``, else
#: the run's own SQLite file.
DB_URL_OPTION = "--ckptdb-db-url"
MIN_INTERVAL_OPTION = "--ckptdb-min-interval"
MAX_INTERVAL_OPTION = "--ckptdb-max-interval"
DB_URL_ENV = "CKPTDB_DB_URL"


# --------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> None:
    """``dp`` with ``train`` through the ledger; every other command is DeePMD-kit's own.

    The entry point of ``python -m ckptdb.integrations.deepmd``: use it in
    place of ``dp``, with ``dp``'s own arguments. ``train`` runs DeePMD-kit's
    own entry point with its ``Trainer`` replaced by ``LedgerTrainer``
    (``--pt``) or ``ExptLedgerTrainer`` (``--pt-expt``); ``freeze``, ``test``,
    ``compress`` and the rest are DeePMD-kit's, unchanged. The run root is the
    working directory (where DeePMD writes its ``checkpoint`` file): the
    ledger is ``ckptdb.sqlite`` there, and the checkpoints stay where DeePMD
    puts them. ``train`` needs one of the PyTorch backends: another would
    train unguarded, so it is refused.

    Args:
        argv: ``dp``'s arguments (None: ``sys.argv[1:]``), plus ckptdb's own
            options, taken out before DeePMD parses the rest:
            ``--ckptdb-guard warn|raise|off`` (default ``warn``: a step with a
            non-finite gradient is not checkpointed and training goes on;
            ``raise`` stops the run with ``NonFiniteGradientError``; ``off``
            leaves DeePMD's own guard as it is);
            ``--ckptdb-preemption SIGNALS`` (``TERM``, ``TERM,USR1``: a
            preemption signal on any rank becomes one agreed checkpoint, then
            every rank exits with the signal's status) and
            ``--ckptdb-grace SECONDS``;
            ``--ckptdb-interval auto|SECONDS`` (a periodic checkpoint also
            whenever the ledger says one is due: the Young/Daly interval from
            the run's save cost and failure rate, within
            ``--ckptdb-min-interval``/``--ckptdb-max-interval`` seconds,
            defaults 60 and 1800);
            ``--ckptdb-db-url URL`` (the ledger; default ``CKPTDB_DB_URL``, else
            the run's own SQLite file);
            ``--ckptdb-remote URL`` (where a replicator copies the run: a
            restart whose checkpoint is missing or corrupt here, or a lost
            machine's run on an empty directory, brings back its copies).
            Each takes ``--option VALUE`` or ``--option=VALUE``.

    Raises:
        UnsupportedVersionError: The installed DeePMD-kit is not a 3.2 release.
        InvalidArgumentError: A bad ckptdb option (a missing value, an unknown
            guard setting or signal name, seconds that are not a number,
            ``--ckptdb-grace`` without ``--ckptdb-preemption``, interval bounds
            without ``--ckptdb-interval``), ``train`` with a backend other than
            PyTorch, or what ``LedgerTrainer`` refuses.
        CheckpointNotFoundError: ``--restart`` names a file with no committed
            row in the run's ledger (``NoCheckpointToResumeError``: nothing
            committed to resume from).
        LedgerLockedError: Another process trains in this run.
        NonFiniteGradientError: With ``--ckptdb-guard raise``, a non-finite
            gradient before a checkpoint.
        Preempted: A preemption signal ended training after its checkpoint (a
            ``SystemExit`` with the signal's exit status).
    """
    check_version()
    args, guard = _take_guard(list(sys.argv[1:] if argv is None else argv))
    args, preemption = _take_preemption(args)
    args, pacing = _take_interval(args)
    args, remote = _take_option(args, REMOTE_OPTION, "an object-storage URL, s3://bucket/prefix")
    args, db_url = _take_option(args, DB_URL_OPTION, "a ledger URL, postgresql://...")
    db_url = db_url or os.environ.get(DB_URL_ENV) or None  # as the ckptdb command reads it
    ledger = LedgerOptions.of(
        guard=guard, preemption=preemption, remote=remote, db_url=db_url, **pacing
    )
    flags = compat.parse_dp_args(args)
    if flags.command != "train":
        compat.run_dp(args)
        return
    options = Options(ledger=ledger, restart=flags.restart)
    factory = _trainer_factory(flags.backend, options)
    try:
        with compat.trainer_replaced_by(factory, flags.backend), compat.gloo_on_the_cpu():
            compat.run_dp(args)
    except SystemExit as exc:  # Preempted is one: the job ends with its exit status
        _drop_tracebacks(exc)  # they hold the trainer: dropped, so that the collection frees it
        raise
    finally:
        collect_process_groups()


def collect_process_groups() -> None:
    """Free, while the interpreter is whole, what DeePMD's trainer leaves in reference
    cycles: its DDP module and the ledger, which hold the (already destroyed) process
    groups.

    Why: collected only at interpreter exit, a gloo process group's destructor
    lets its worker threads finish, and a worker dropping the last tensors of a
    collective it ran needs the GIL, which no thread may take once the
    interpreter is finalizing: CPython ends that thread with ``pthread_exit``,
    whose unwinding through torch's C++ aborts the process ("terminate called
    without an active exception", exit status -6 after a run that succeeded).
    Seen on a loaded machine on about one torchrun in fifteen. A run ended by a
    ``SystemExit`` (a preemption's ``Preempted``) has its tracebacks dropped first,
    or they would keep the trainer alive through the collection. Any other error
    keeps its traceback for the report, and with it the trainer until exit: the
    job has failed already, and its report is printed before the interpreter
    finalizes.
    """
    gc.collect()


def _drop_tracebacks(exc: BaseException) -> None:
    """The tracebacks of ``exc`` and of the exceptions it chains (``__context__``,
    ``__cause__``), dropped. A frame keeps its function, and DeePMD's training step is
    a closure over the trainer, so clearing the frames' locals is not enough. Only for
    a ``SystemExit``, whose traceback Python never shows."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__context__, current.__cause__]


def _trainer_factory(backend: str, options: Options) -> Callable[..., Any]:
    """The ledger's trainer of ``backend``; any other backend is refused."""
    if backend == compat.PYTORCH:
        return partial(LedgerTrainer, ckptdb=options)
    if backend == compat.PYTORCH_EXPORTABLE:
        return partial(ExptLedgerTrainer, ckptdb=options)
    raise InvalidArgumentError(
        f"ckptdb trains DeePMD-kit's PyTorch backends only (--pt, --pt-expt), not "
        f"{backend!r}: pass --pt or --pt-expt (or set DP_BACKEND=pytorch)"
    )


def _take_option(args: list[str], option: str, expected: str) -> tuple[list[str], str | None]:
    """``option X`` / ``option=X`` out of ``args`` (the last one counts); the rest as typed."""
    rest: list[str] = []
    value: str | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == option:
            if i + 1 >= len(args):
                raise InvalidArgumentError(f"{option} needs a value: {expected}")
            value, i = args[i + 1], i + 2
            continue
        if arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return rest, value


def _take_guard(args: list[str]) -> tuple[list[str], common.GuardSetting]:
    """``--ckptdb-guard warn|raise|off`` out of ``args`` (default ``warn``)."""
    rest, value = _take_option(args, GUARD_OPTION, "warn, raise or off")
    if value is None:
        return rest, True
    if value not in GUARD_CHOICES:
        raise InvalidArgumentError(f"{GUARD_OPTION} must be warn, raise or off, got {value!r}")
    return rest, GUARD_CHOICES[value]


def _take_preemption(args: list[str]) -> tuple[list[str], OnPreemption | None]:
    """``--ckptdb-preemption TERM,USR1`` and ``--ckptdb-grace 25`` out of ``args``."""
    rest, names = _take_option(args, PREEMPTION_OPTION, "signal names, e.g. TERM or TERM,USR1")
    rest, grace = _take_option(rest, GRACE_OPTION, "a number of seconds")
    if names is None:
        if grace is not None:
            raise InvalidArgumentError(f"{GRACE_OPTION} needs {PREEMPTION_OPTION}")
        return rest, None
    signals = []
    for name in filter(None, (n.strip().upper() for n in names.split(","))):
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full not in signal.Signals.__members__:
            raise InvalidArgumentError(f"{PREEMPTION_OPTION}: {name!r} is not a signal name")
        signals.append(signal.Signals[full])
    try:
        seconds = float(grace) if grace is not None else None
    except ValueError:
        raise InvalidArgumentError(f"{GRACE_OPTION} must be seconds, got {grace!r}") from None
    return rest, OnPreemption(signals=signals, grace=seconds)


def _take_interval(args: list[str]) -> tuple[list[str], dict[str, object]]:
    """``--ckptdb-interval auto|SECONDS`` and its bounds ``--ckptdb-min-interval`` /
    ``--ckptdb-max-interval`` (seconds) out of ``args``: LedgerOptions' arguments."""
    rest, interval = _take_option(args, INTERVAL_OPTION, "auto, or a number of seconds")
    rest, low = _take_option(rest, MIN_INTERVAL_OPTION, "a number of seconds")
    rest, high = _take_option(rest, MAX_INTERVAL_OPTION, "a number of seconds")
    if interval is None:
        if low is not None or high is not None:
            raise InvalidArgumentError(f"the interval's bounds need {INTERVAL_OPTION}")
        return rest, {}
    found: dict[str, object] = {
        "interval": interval if interval == "auto" else _seconds(interval, INTERVAL_OPTION)
    }
    if low is not None:
        found["min_interval"] = _seconds(low, MIN_INTERVAL_OPTION)
    if high is not None:
        found["max_interval"] = _seconds(high, MAX_INTERVAL_OPTION)
    return rest, found


def _seconds(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidArgumentError(f"{option} must be seconds, got {text!r}") from None


# ------------------------------------------------------------------- trainer


class LedgerTrainer(LedgerTraining, compat.HookedTrainer):
    """DeePMD-kit's ``--pt`` ``Trainer`` whose checkpoints are ledger boundaries.

    You do not construct it: ``main`` has DeePMD-kit's own ``get_trainer``
    build it in place of ``deepmd.pt.train.training.Trainer`` while ``dp
    train`` runs. The ledger is opened first (in the working directory, the
    run root), so that ``--restart`` resolves through it and DeePMD loads only
    a committed, verified checkpoint (see ``resolve_restart``); the checkpoint
    resumed from is protected while the run is open, and the resume recorded.

    Once DeePMD's constructor has run, the ledger takes over its checkpoints:

    - ``model.ckpt-<N>.pt`` (stream ``model``, ``Keep(last=max_ckpt_keep)``)
      and its EMA twin ``model_ema.ckpt-<N>.pt`` (stream ``model_ema``) are
      written by DeePMD's own ``torch.save`` into a temporary name, then
      fsynced, hashed, renamed and committed as one boundary: both or neither.
    - Validation-best checkpoints go to the top-K streams ``best`` and
      ``best_ema`` as ``best.ckpt-<N>.pt`` (no rank in the name: the ledger
      ranks, and a name never changes).
    - DeePMD's pruning and its renaming and deleting of best files never run:
      a file goes after the commit that evicted it, and a name that is taken
      gets ``-v1``...
    - ``model.ckpt.pt``, ``model_ema.ckpt.pt`` and ``checkpoint`` are aliases
      re-pointed after each commit at the ledger's latest; ckptdb never reads
      them.
    - ckptdb's guard sees every optimizer step's gradients (after DeePMD's
      clipping) and refuses every checkpoint of a step after a non-finite
      one; training goes on (``--ckptdb-guard raise`` stops it). DeePMD's own
      guard is not fed while ckptdb's is on.
    - ``lcurve.out`` and ``val.log`` rows become the run's metrics, committed
      with the next checkpoint.

    On several ranks (``torchrun``, ``training.zero_stage`` 0) DeePMD saves
    from rank 0 alone; every rank joins each boundary, and rank 0's plan of
    it (step, names, metrics) is broadcast first. The attempt ends with
    DeePMD's training loop (failed if it raised).

    Args:
        config: DeePMD's training configuration (``input.json``, as DeePMD
            normalized it); its ``training`` and ``validating`` sections decide
            the streams and where the checkpoints go.
        training_data: DeePMD's training data, as ``get_trainer`` passes it.
        *args: DeePMD's other positional arguments of its ``Trainer``
            (``stat_file_spec``, ``validation_data``...), passed on.
        ckptdb: ckptdb's options from the command line: the ledger options
            (guard, preemption, interval, remote, db_url) and ``--restart`` as
            typed.
        restart_model: DeePMD's ``--restart`` checkpoint (None: no restart).
            Resolved through the ledger; DeePMD is given the committed,
            verified checkpoint it names.
        **kwargs: DeePMD's other keyword arguments of its ``Trainer``
            (``init_model``, ``finetune_model``, ``init_frz_model``...), passed
            on unchecked: they start a new trajectory, not a resume.

    Raises:
        InvalidArgumentError: A configuration ckptdb does not support
            (``zero_stage`` above 0 on several ranks, checkpoint directories that
            share no directory of the run or leave the run's recorded save
            directory, ``save_ckpt`` outside the working directory,
            ``ckpt_keep_ratio`` without ``numb_steps``), ``--restart`` naming
            another run's directory, or ``--ckptdb-preemption`` or
            ``--ckptdb-interval`` with the LKF optimizer.
        CheckpointNotFoundError: ``--restart`` names a file with no committed
            row in this run's ledger.
        NoCheckpointToResumeError: ``--restart`` names a stream with no
            committed checkpoint.
        CheckpointLostError: The checkpoint ``--restart`` names is gone (marked
            ``lost``).
        CorruptCheckpointError: The checkpoint ``--restart`` names no longer
            matches its row (marked ``corrupt``).
        LedgerLockedError: Another process trains in this run.
        RunDirectoryError: The working directory cannot hold a run.
    """

    def __init__(
        self,
        config: dict[str, Any],
        training_data: Any,
        *args: Any,
        ckptdb: Options,
        restart_model: str | None = None,
        **kwargs: Any,
    ) -> None:
        self._ckptdb_pending: tuple[int, Path, dict[str, Any]] | None = None

        def construct(restart: str | None) -> None:
            deepmds: Any = compat.HookedTrainer.__init__  # DeePMD's, untyped
            with compat.ddp_on_the_cpu():
                deepmds(self, config, training_data, *args, restart_model=restart, **kwargs)

        self._ckptdb_start(config, ckptdb, restart_model, construct)

    def ckptdb_write_checkpoint(
        self, path: Path, checkpoint_data: dict[str, Any], *, store: Any
    ) -> None:
        """Every checkpoint file DeePMD writes comes here, as a ledger boundary.

        DeePMD's private ``Trainer._write_checkpoint`` is forwarded here. A
        regular checkpoint (rank 0) is held until its EMA twin arrives
        (DeePMD writes them one after the other, nothing trains in between),
        then both are one boundary; without EMA the regular one is a boundary
        by itself. A validation-best checkpoint is one boundary of its top-K
        stream, which every rank joins. DeePMD's own write fills the path
        ckptdb chooses; its store prunes nothing.

        Args:
            path: DeePMD's path of the checkpoint (its name decides the stream).
            checkpoint_data: The checkpoint DeePMD serializes.
            store: DeePMD's store of the checkpoint's names (regular, EMA), or
                another for a best checkpoint.

        Raises:
            InvalidArgumentError: ``path`` is neither a periodic nor a
                validation-best checkpoint of this run.
            NonFiniteGradientError: With ``--ckptdb-guard raise``, a non-finite
                gradient since the previous checkpoint.
            PublishError: The write or the commit failed; nothing was published.
            Preempted: This was the preemption checkpoint of the agreed step.
        """
        if store is self.ckpt_store and store.holds(path):
            self._ckptdb_pending = (int(store.step_of(path)), path, checkpoint_data)
            if self.model_ema is None:
                self._ckptdb_publish_held(self._ckptdb_pending[0], None)
            return
        if store is self.ema_ckpt_store and store.holds(path):
            self._ckptdb_publish_held(int(store.step_of(path)), checkpoint_data)
            return
        best = self._ckptdb_best_stream(path)
        if best is None:
            raise self._ckptdb_unexpected(path)
        stream, validator, step = best
        self._ckptdb_publish_best(stream, validator, step, self._ckptdb_write_data(checkpoint_data))

    def _ckptdb_publish_held(self, step: int, ema: dict[str, Any] | None) -> None:
        """One boundary (rank 0): the held regular checkpoint of ``step`` and its EMA twin."""
        pending, self._ckptdb_pending = self._ckptdb_pending, None
        writers: dict[str, Writer] = {}
        if pending is not None and pending[0] == step:
            writers[STREAM] = self._ckptdb_write_data(pending[2])
        if ema is not None:
            writers[EMA_STREAM] = self._ckptdb_write_data(ema)
        self._ckptdb_publish_periodic(step, writers)

    def _ckptdb_write_data(self, data: dict[str, Any]) -> Writer:
        """DeePMD's own write of ``data`` (rank 0 holds it), pruning nothing."""
        return partial(self._ckptdb_deepmd_write, data)

    def _ckptdb_deepmd_write(self, data: dict[str, Any], target: Path) -> None:
        self.deepmd_write_checkpoint(target, data, store=_KEEP_ALL)


class _KeepAll:
    """The store DeePMD's write is handed inside a boundary: it prunes nothing."""

    def prune(self, current: Path) -> None:
        """Retention is the ledger's: files go after the commit that evicted them."""


_KEEP_ALL = _KeepAll()

from .train_expt import ExptLedgerTrainer  # noqa: E402  # the other backend's, re-exported
