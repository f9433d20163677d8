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
    """``dp`` with ``train`` through the ledger; every other command is DeePMD's own.

    ``argv`` are ``dp``'s arguments (default ``sys.argv[1:]``), plus
    ``--ckptdb-guard warn|raise|off`` (default ``warn``),
    ``--ckptdb-preemption SIGNALS`` (``TERM``, ``TERM,USR1``: a preemption
    signal on any rank becomes one agreed checkpoint, then the job exits with
    the signal's status), ``--ckptdb-grace SECONDS``, ``--ckptdb-remote URL``
    (where a replicator copies the run: a restart whose checkpoint is missing
    or corrupt here, or a lost machine's run on an empty directory, brings back
    its copies), ``--ckptdb-db-url URL`` (the ledger; default the run's own
    SQLite file, or ``CKPTDB_DB_URL``) and ``--ckptdb-interval auto|SECONDS``
    (a periodic checkpoint also whenever the ledger says one is due: the
    Young/Daly interval from the run's save cost and failure rate, within
    ``--ckptdb-min-interval``/``--ckptdb-max-interval`` seconds; see
    docs/goodput.md), which are taken out before DeePMD parses them.
    ``train`` needs one of the PyTorch backends (``--pt``, ``--pt-expt``):
    another backend would train unguarded, so it is refused.
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

    Constructed by DeePMD's own ``get_trainer`` (``main`` substitutes it for
    DeePMD's ``Trainer``: :func:`.compat.trainer_replaced_by`). The ledger is
    opened before DeePMD's constructor runs, so that ``--restart`` is resolved
    through it and DeePMD loads only a committed, verified checkpoint. It
    overrides none of DeePMD's private methods: :class:`.compat.HookedTrainer`
    forwards them to the ``ckptdb_*`` methods here.
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
        """Every checkpoint DeePMD writes comes here (rank 0): a regular one is held until
        its EMA twin arrives (DeePMD writes them one after the other, nothing trains
        in between), then both are one ledger boundary; without EMA the regular one
        is a boundary by itself."""
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
