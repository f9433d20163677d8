"""``dp --pt train`` through a ckptdb ledger (see the package docstring).

It drives DeePMD's ``Trainer`` (its checkpoint writer, its stores, its
guard) through :mod:`.compat`, the one module that imports DeePMD-kit and
holds every private name borrowed from it; importing this module imports
:mod:`.compat`, which refuses any DeePMD-kit but the tested 3.2 series
(:func:`check_version`) before DeePMD's internals are imported. It refuses
what it does not guard yet (sharded ZeRO/FSDP training, a best-checkpoint
directory outside the save directory) rather than let DeePMD write or delete
checkpoints behind the ledger's back.

Several ranks (``torchrun``): DeePMD saves from rank 0 alone, and a ckptdb
boundary is collective, so every boundary starts with the chief's
description of it (:class:`_Plan`, :meth:`CheckpointManager.from_chief`),
which every rank receives at the same point of DeePMD's loop: the periodic
checkpoint at DeePMD's own pre-save guard check (every rank calls it), a
validation-best one in the validator's save (every rank is made to enter
it), and what rank 0 saves after the loop once training has ended
(:meth:`LedgerTrainer.run`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...errors import (
    CheckpointLostError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    NoCheckpointToResumeError,
    NonFiniteGradientError,
    RunDirectoryError,
    note_on,
)
from ...guard import NonFiniteGradGuard
from ...policies import Keep, Policy, TopK
from ...preemption import OnPreemption, Preemption
from ...record import Checkpoint, DerivedAlias
from ...storage.external import External
from .. import common
from ..contract import IntegrationLedger, LedgerOptions
from . import compat  # checks DeePMD-kit's version before importing any of its internals
from .compat import SUPPORTED, SUPPORTED_RANGE, check_version
from .layout import BEST_EMA_STREAM, BEST_STREAM, EMA_STREAM, POINTER, STREAM
from .logs import LogTail

__all__ = [
    "SUPPORTED",
    "SUPPORTED_RANGE",
    "LedgerTrainer",
    "LogTail",
    "check_version",
    "main",
    "resolve_restart",
]

log = logging.getLogger("ckptdb.deepmd")

#: ckptdb's own option (taken out of the argument list before DeePMD parses it).
GUARD_OPTION = "--ckptdb-guard"
GUARD_CHOICES: dict[str, common.GuardSetting] = {"warn": True, "raise": "raise", "off": False}
#: ckptdb's preemption options: the signals (``TERM``, ``TERM,USR1``...) and the grace.
PREEMPTION_OPTION = "--ckptdb-preemption"
GRACE_OPTION = "--ckptdb-grace"
#: Where a replicator copies the run (``s3://bucket/prefix``): see CheckpointManager(remote=).
REMOTE_OPTION = "--ckptdb-remote"


@dataclass(frozen=True)
class Options:
    """What the command line gave ckptdb: the ledger options (guard, preemption, remote)
    and ``--restart`` as typed."""

    ledger: LedgerOptions = field(default_factory=LedgerOptions)
    restart: str | None = None


# --------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> None:
    """``dp`` with ``train`` through the ledger; every other command is DeePMD's own.

    ``argv`` are ``dp``'s arguments (default ``sys.argv[1:]``), plus
    ``--ckptdb-guard warn|raise|off`` (default ``warn``),
    ``--ckptdb-preemption SIGNALS`` (``TERM``, ``TERM,USR1``: a preemption
    signal on any rank becomes one agreed checkpoint, then the job exits with
    the signal's status), ``--ckptdb-grace SECONDS`` and ``--ckptdb-remote URL``
    (where a replicator copies the run: a restart whose checkpoint is missing or
    corrupt here brings back its copy), which are taken out before DeePMD parses
    them. ``train`` needs the PyTorch backend (``--pt``):
    another backend would train unguarded, so it is refused.
    """
    check_version()
    args, guard = _take_guard(list(sys.argv[1:] if argv is None else argv))
    args, preemption = _take_preemption(args)
    args, remote = _take_option(args, REMOTE_OPTION, "an object-storage URL, s3://bucket/prefix")
    ledger = LedgerOptions.of(guard=guard, preemption=preemption, remote=remote)
    flags = compat.parse_dp_args(args)
    if flags.command != "train":
        compat.run_dp(args)
        return
    if flags.backend != "pytorch":
        raise InvalidArgumentError(
            f"ckptdb trains DeePMD-kit's PyTorch backend only, not {flags.backend!r}: "
            "pass --pt (or set DP_BACKEND=pytorch)"
        )
    options = Options(ledger=ledger, restart=flags.restart)
    with (
        compat.trainer_replaced_by(partial(LedgerTrainer, ckptdb=options)),
        compat.gloo_on_the_cpu(),
    ):
        compat.run_dp(args)


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


# ------------------------------------------------------------------- trainer


class LedgerTrainer(compat.HookedTrainer):
    """DeePMD-kit's ``Trainer`` whose periodic checkpoints are ledger boundaries.

    Constructed by DeePMD's own ``get_trainer`` (``main`` substitutes it for
    DeePMD's ``Trainer``: :func:`.compat.trainer_replaced_by`). The ledger is
    opened before DeePMD's constructor runs, so that ``--restart`` is resolved
    through it and DeePMD loads only a committed, verified checkpoint. It
    overrides none of DeePMD's private methods: :class:`.compat.HookedTrainer`
    forwards them to the ``ckptdb_*`` methods here.
    """

    nonfinite_grad_guard: Any  # DeePMD's, wrapped by :class:`_DeepmdGuard`

    def __init__(
        self,
        config: dict[str, Any],
        training_data: Any,
        *args: Any,
        ckptdb: Options,
        restart_model: str | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_unsupported(config)
        self.ckptdb = ckptdb
        self.run_root = Path.cwd().resolve()  # where DeePMD writes its `checkpoint` pointer
        #: The run this trainer holds (the integration contract).
        self.ledger = IntegrationLedger.open(
            self.run_root,
            ckptdb.ledger,
            streams=_streams(config),
            save_dir=_save_dir(config["training"], self.run_root),
        )
        #: The run's training-loop surface (latest, best, verify, log_metrics).
        self.manager = self.ledger.manager
        self.resumed: Checkpoint | None = None
        self._ckptdb_pending: tuple[int, Path, dict[str, Any]] | None = None
        self._ckptdb_refused_step: int | None = None
        self._ckptdb_hook: Any = None
        self._ckptdb_stop: Preemption | None = None
        self._ckptdb_stop_hook: Any = None
        self._ckptdb_steps_done = 0  # this attempt's optimizer steps, counted from start_step
        self._ckptdb_tails: list[LogTail] = []
        try:
            if restart_model is not None:
                spec = ckptdb.restart if ckptdb.restart is not None else restart_model
                self.resumed = resolve_restart(
                    self.ledger, spec, root=self.run_root, aliases=_aliases(config)
                )
                restart_model = os.fspath(self.resumed.path)
                self.ledger.resume_from(self.resumed)
            else:
                self.ledger.start_afresh()
            with compat.ddp_on_the_cpu():
                super().__init__(
                    config, training_data, *args, restart_model=restart_model, **kwargs
                )
            self._ckptdb_take_over()
        except BaseException as exc:
            self._ckptdb_close(exc)
            raise

    def _ckptdb_take_over(self) -> None:
        """After DeePMD's constructor: its retention, aliases and guard become the ledger's."""
        for _, store in self._ckptdb_stores():
            if store.directory.resolve() != self.manager.save_dir:
                raise InvalidArgumentError(  # pragma: no cover - both read the same keys
                    f"DeePMD writes checkpoints to {store.directory}, the ledger expects "
                    f"{self.manager.save_dir}"
                )
            # retention is the ledger's; the aliases are written after each commit
            store.prune = _never
            store.publish = _never
        guard_on = bool(self.ckptdb.ledger.guard)
        self.nonfinite_grad_guard = _DeepmdGuard(
            self.nonfinite_grad_guard,
            defer=guard_on,
            # rank 0 publishes from DeePMD's save; every other rank joins here
            before_save=None if self.manager.is_chief else self._ckptdb_follow,
        )
        if guard_on:
            self.manager.guard = NonFiniteGradGuard(self.wrapper.named_parameters())
            self._ckptdb_hook = self.optimizer.register_step_pre_hook(self._observe)
        if self.ckptdb.ledger.preemption is not None:
            self._ckptdb_handle_preemption()
        self._ckptdb_point_aliases(stale_warning=True)
        self._ckptdb_tails = self._ckptdb_log_tails()

    def _ckptdb_handle_preemption(self) -> None:
        """Install the preemption handlers (collective) and the per-step check."""
        if self.opt_type == "LKF":
            raise InvalidArgumentError(
                f"{PREEMPTION_OPTION} needs a torch optimizer: the LKF optimizer's steps "
                "cannot be counted, so no rank could agree on a step to checkpoint"
            )
        self._ckptdb_steps_done = int(self.start_step)
        self._ckptdb_stop = self.ledger.preemption()
        self._ckptdb_stop_hook = self.optimizer.register_step_post_hook(
            self._ckptdb_check_preemption
        )

    def _ckptdb_log_tails(self) -> list[LogTail]:
        """``lcurve.out`` (``disp_file``) and each validator's ``val.log``, read from where
        this attempt starts writing: the end of the file on a restart (DeePMD appends),
        the start once DeePMD has rewritten it otherwise. Rank 0's only: DeePMD
        writes them there, and the ledger records the chief's metrics."""
        if not self.manager.is_chief:
            return []
        tails = [
            LogTail(self.run_root / self.disp_file, append=bool(self.restart_training), skip={"lr"})
        ]
        for stream, validator in self._ckptdb_validators():
            tails.append(
                LogTail(
                    self.run_root / validator.full_val_file,
                    prefix=VAL_PREFIX[stream],
                    append=compat.validator_appends(validator),
                )
            )
        return tails

    def _ckptdb_log_files(self) -> None:
        """What DeePMD appended to its log files since the last look, as ledger metrics
        (buffered: written with the next commit, or when the ledger closes)."""
        for tail in self._ckptdb_tails:
            for step, values in tail.read():
                self.manager.log_metrics(step, values)

    def _ckptdb_stores(self) -> list[tuple[str, Any]]:
        """Each stream with DeePMD's store of its names (the EMA one when EMA is on)."""
        pairs = [(STREAM, self.ckpt_store)]
        if self.model_ema is not None:
            pairs.append((EMA_STREAM, self.ema_ckpt_store))
        return pairs

    # ------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """DeePMD's training loop; the ledger's attempt ends with it (failed on an error).

        Once the loop is over, rank 0 may still save (``change_bias_after_training``,
        ``numb_steps: 0``) while the other ranks have nothing left to do: they join
        each such boundary until rank 0 says it is done (a plan of None).
        """
        try:
            super().run()
            if self.ledger.is_chief:
                self.ledger.from_chief(None, what=PLAN)
            else:
                while (plan := self.ledger.from_chief(None, what=PLAN)) is not None:
                    self._ckptdb_publish_plan(plan, {})
        except BaseException as exc:
            self._ckptdb_close(exc)
            raise
        self._ckptdb_close(None)

    def _ckptdb_close(self, exc: BaseException | None) -> None:
        for name in ("_ckptdb_hook", "_ckptdb_stop_hook"):
            hook = getattr(self, name)
            setattr(self, name, None)
            if hook is not None:
                hook.remove()
        try:  # the rows written after the last boundary
            self._ckptdb_log_files()
        except Exception as failed:  # never in place of the attempt's own outcome
            text = f"ckptdb: the last rows of DeePMD's logs were not recorded: {failed!r}"
            if exc is not None:
                note_on(exc, text)  # the training's own error is the one raised
            else:  # training succeeded: its checkpoints stand, the lost metrics are said
                log.error(text, exc_info=True)
        self.ledger.close(exc)

    # -------------------------------------------------------------- saving

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
                self._ckptdb_publish(self._ckptdb_pending[0], None)
            return
        if store is self.ema_ckpt_store and store.holds(path):
            self._ckptdb_publish(int(store.step_of(path)), (path, checkpoint_data))
            return
        for stream, validator in self._ckptdb_validators():
            match = validator.best_checkpoint_pattern.match(path.name)
            if match is not None and path.parent.resolve() == validator.checkpoint_dir.resolve():
                self._ckptdb_publish_best(stream, validator, int(match[1]), checkpoint_data)
                return
        raise InvalidArgumentError(  # nothing else is written by DeePMD's training loop
            f"ckptdb's DeePMD-kit integration does not publish {path}: only the periodic "
            "and the validation-best checkpoints go through the ledger"
        )

    def _ckptdb_publish(self, step: int, ema: tuple[Path, dict[str, Any]] | None) -> None:
        """One boundary (rank 0): the held regular checkpoint of ``step`` and its EMA twin."""
        pending, self._ckptdb_pending = self._ckptdb_pending, None
        names: dict[str, str] = {}
        data: dict[str, dict[str, Any]] = {}
        if pending is not None and pending[0] == step:
            names[STREAM], data[STREAM] = pending[1].name, pending[2]
        if ema is not None:
            names[EMA_STREAM], data[EMA_STREAM] = ema[0].name, ema[1]
        self._ckptdb_boundary(_Plan(step, names, self._ckptdb_metrics()), data)

    def _ckptdb_follow(self) -> None:
        """A rank other than 0, where DeePMD checks its guard before rank 0 saves the
        periodic checkpoint: this rank's part of that boundary (rank 0's plan)."""
        self._ckptdb_boundary(None, {})

    def _ckptdb_publish_best(
        self, stream: str, validator: Any, step: int, data: dict[str, Any]
    ) -> None:
        """A validation-best checkpoint: one boundary of its top-K stream, ranked by
        DeePMD's validation metric, under DeePMD's name without the rank (``-t-R``):
        the ledger ranks, a name never changes. Every rank comes here
        (:class:`_LedgerValidator`); rank 0 alone has evaluated, so its plan is
        everyone's."""
        plan: _Plan | None = None
        if self.manager.is_chief:
            value = next(r.metric for r in validator.topk_records if r.step == step)
            metric = self.manager.policies[stream].ranking_metric
            assert metric is not None
            metrics = common.rankable_metrics(
                {**(self._ckptdb_metrics() or {}), metric: value},
                self.manager.policies[stream],
                step=step,
                log=log,
            )
            name = os.path.relpath(
                validator.checkpoint_dir.resolve()
                / f"{validator.best_checkpoint_prefix}-{step}{validator.best_checkpoint_suffix}",
                self.manager.save_dir,
            )
            plan = _Plan(step, {stream: name}, metrics)
        saved = self._ckptdb_boundary(plan, {stream: data})
        if self.manager.is_chief and (saved is None or stream not in saved):
            # refused, or not in the ledger's top-K: DeePMD's own top-K (which decides
            # what it proposes next, and is saved in its checkpoints) drops it too
            validator.topk_records = [r for r in validator.topk_records if r.step != step]
            compat.sync_topk_state(validator)

    def _ckptdb_boundary(
        self, plan: _Plan | None, data: Mapping[str, dict[str, Any]]
    ) -> dict[str, Checkpoint] | None:
        """Rank 0's ``plan``, on every rank (the others pass None), then the boundary.

        The periodic boundary of the step a preemption was agreed on is the
        preemption checkpoint (within the grace period); then every rank
        raises :class:`~ckptdb.Preempted` (the job exits with the signal's status).
        """
        agreed = self.ledger.from_chief(plan, what=PLAN)
        assert agreed is not None  # rank 0 sends None only once training has ended
        stop = self._ckptdb_stop
        if stop is None or stop.agreed_step != agreed.step or STREAM not in agreed.names:
            return self._ckptdb_publish_plan(agreed, data)
        saved = stop.publish(
            agreed.step, lambda: self._ckptdb_publish_plan(agreed, data, aliases=False)
        )
        preempted = stop.stop(agreed.step, list((saved or {}).values()))
        if saved is not None and saved.keys() & {STREAM, EMA_STREAM}:
            try:  # after the outcome is recorded: a refused alias is not a lost checkpoint
                self._ckptdb_point_aliases()
            except RunDirectoryError as exc:
                log.error("ckptdb: %s (the next `ckptdb reconcile` re-points it)", exc)
                note_on(preempted, f"ckptdb: {exc}")
        raise preempted

    def _ckptdb_publish_plan(
        self, plan: _Plan, data: Mapping[str, dict[str, Any]], *, aliases: bool = True
    ) -> dict[str, Checkpoint] | None:
        """``manager.save`` of the plan's checkpoints, written from ``data`` (rank 0's;
        another rank writes nothing); None when the guard refused the step.

        A refusal is :meth:`IntegrationLedger.publish_all`'s (the manager has recorded
        ``guard_tripped``; ``raise`` re-raises, otherwise a warning and training
        goes on); it also refuses every later boundary of the step (the
        periodic checkpoint after a best one). After a commit the aliases follow.
        """
        self._ckptdb_log_files()  # the rows so far commit with this boundary
        step = plan.step
        if self._ckptdb_refused_step == step:
            log.warning("ckptdb: step %d was not checkpointed: the guard refused this step", step)
            return None

        def refused(exc: NonFiniteGradientError) -> None:
            self._ckptdb_refused_step = step

        payloads = {
            stream: External(
                self._writer(data.get(stream)),
                self.ledger.free_name(name, suffix=".pt"),
            )
            for stream, name in plan.names.items()
        }
        saved = self.ledger.publish_all(
            step, payloads, metrics=plan.metrics, log=log, refused=refused
        )
        if aliases and saved is not None and saved.keys() & {STREAM, EMA_STREAM}:
            self._ckptdb_point_aliases()
        return saved

    def _ckptdb_metrics(self) -> dict[str, float] | None:
        lr = compat.train_infos(self).get("lr")
        return {"lr": float(lr)} if isinstance(lr, (int, float)) else None

    def _writer(self, data: dict[str, Any] | None) -> Callable[[Path], None]:
        """DeePMD's own write of ``data`` (rank 0); nothing on another rank, which has
        no data: in a plain (unsharded) boundary the chief alone writes."""

        def write(target: Path) -> None:
            if data is not None and self.manager.is_chief:
                self.deepmd_write_checkpoint(target, data, store=_KEEP_ALL)

        return write

    # ------------------------------------------------------------ validation

    def ckptdb_full_validator_class(self) -> Any:
        """DeePMD's full validators, without their own renaming and deleting of
        ``best.ckpt-*`` files (:class:`_LedgerValidator`): the ledger's top-K does it."""
        return _LedgerValidator

    def _ckptdb_validators(self) -> list[tuple[str, Any]]:
        pairs = [(BEST_STREAM, self.full_validator), (BEST_EMA_STREAM, self.ema_full_validator)]
        return [(stream, v) for stream, v in pairs if v is not None]

    # ------------------------------------------------------------- aliases

    def _ckptdb_point_aliases(self, *, stale_warning: bool = False) -> None:
        """``model.ckpt.pt`` (``model_ema.ckpt.pt``) and ``checkpoint`` name the ledger's
        latest of each stream: derived aliases of the ledger
        (:meth:`CheckpointManager.derive_aliases`), written after the commit,
        swapped in atomically, never read by ckptdb, and re-pointed by every
        reconcile (the open's included) when a crash left them stale. Collective:
        the chief writes. At start (``stale_warning``) the open's repairs of them
        are said as a warning."""
        aliases = [
            DerivedAlias(
                _alias_path(store, self.run_root).relative_to(self.run_root).as_posix(),
                stream,
                "symlink",
            )
            for stream, store in self._ckptdb_stores()
        ]
        aliases.append(DerivedAlias(POINTER, STREAM, "pointer"))
        self.manager.derive_aliases(aliases)
        if stale_warning and self.manager.is_chief:
            for action in self.manager.last_reconcile.actions:
                if action.kind == "aliased":
                    log.warning("ckptdb: a stale alias re-pointed at start: %s", action)

    # --------------------------------------------------------------- guard

    def _ckptdb_check_preemption(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> None:
        """After each optimizer step, on every rank: were we told to stop?

        When every rank agrees, DeePMD is made to save a periodic checkpoint at
        the end of this step (its ``save_freq`` becomes this step's number):
        the checkpoint is written the way DeePMD always writes it, with the
        scheduler and EMA updates of the step in it, and its boundary raises
        :class:`~ckptdb.Preempted` (:meth:`_ckptdb_boundary`). The first step of an
        attempt is never the agreed one: DeePMD never saves at it; nor is the
        last: a signal then lets the finished run end as it does (its final
        checkpoint is saved anyway).
        """
        self._ckptdb_steps_done += 1
        step = self._ckptdb_steps_done  # DeePMD's display step: the checkpoint's number
        stop = self._ckptdb_stop
        if stop is None:
            return
        if stop.agreed_step is not None:  # agreed, and DeePMD went on without saving it
            log.error(
                "ckptdb: DeePMD did not save the preemption checkpoint of step %d; "
                "stopping at step %d without it (the last committed checkpoint stands)",
                stop.agreed_step,
                step,
            )
            raise stop.stop(stop.agreed_step)
        if step == self.start_step + 1 or step >= self.num_steps:
            return  # DeePMD never saves at the first step; after the last one training is over
        if stop.requested(step):
            self.save_freq = step

    def _observe(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Every optimizer step's gradients, after DeePMD's clipping, to ckptdb's guard
        (on the device: no host sync per step)."""
        guard = self.manager.guard
        if guard is not None:
            guard.observe(common.optimizer_params(optimizer))


#: The metric-name prefix of each validator's log (``val.log``, ``val_ema.log``).
VAL_PREFIX = {BEST_STREAM: "val_", BEST_EMA_STREAM: "val_ema_"}
#: The name of the collective that shares rank 0's plan of a boundary.
PLAN = "deepmd checkpoint"


@dataclass(frozen=True)
class _Plan:
    """One boundary as rank 0 (the rank DeePMD saves from) sees it, for every rank:
    the step, DeePMD's name of each stream's checkpoint (relative to the save
    directory, before ckptdb adds a version to a taken one) and the boundary's
    metrics (the validation metric is rank 0's alone)."""

    step: int
    names: dict[str, str]
    metrics: Mapping[str, Any] | None


class _DeepmdGuard:
    """DeePMD's own ``NonFiniteGradGuard`` (it raises at the next periodic checkpoint
    after a non-finite clipped-gradient norm, killing the run), deferring to ckptdb's.

    With ckptdb's guard on, DeePMD's is not fed: a non-finite total norm makes the
    clipping scale every gradient by NaN, which ckptdb's guard sees at the
    optimizer step; the boundary is refused and training goes on (``warn``) or
    stops with :class:`NonFiniteGradientError` (``raise``). With ckptdb's guard
    off, DeePMD's own works as it always does.
    """

    def __init__(
        self, inner: Any, *, defer: bool, before_save: Callable[[], None] | None = None
    ) -> None:
        self.inner = inner
        self.defer = defer
        self.before_save = before_save

    def update(self, total_norm: torch.Tensor) -> None:
        if not self.defer:
            self.inner.update(total_norm)

    def raise_if_nonfinite(self, named_parameters: Callable[[], Any]) -> None:
        """DeePMD calls it on every rank just before rank 0 saves a periodic
        checkpoint: a rank other than 0 joins that boundary here (``before_save``)."""
        self.inner.raise_if_nonfinite(named_parameters)
        if self.before_save is not None:
            self.before_save()


class _LedgerValidator(compat.HookedValidator):
    """DeePMD's ``FullValidator`` that never renames nor deletes a best checkpoint.

    DeePMD names its best checkpoints by rank (``best.ckpt-N.t-R.pt``), renames
    them as the ranking changes and deletes the ones that drop out, at start
    (every best file of an earlier run) and after each save, by name. Here
    every best checkpoint is a row of a top-K stream: its name never changes
    and the ledger evicts it after the commit that pushed it out.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sharding: Any = getattr(self, "sharding")  # noqa: B009  # DeePMD's, untyped
        if self.is_distributed and not sharding.enabled:
            self.sharding = _EveryRankSaves(sharding)

    def ckptdb_initialize_best_checkpoints(self, restart_training: bool) -> None:
        """Never: the files of an earlier run are the ledger's (or no one's) to remove."""

    def ckptdb_reconcile_best_checkpoints(self) -> None:
        """Never: the ledger's top-K ranks and evicts."""


class _EveryRankSaves:
    """The validator's view of DeePMD's sharding policy under several ranks: every
    rank enters the best checkpoint's save, as DeePMD has them do when the
    save is collective (sharded state). A ckptdb boundary is collective: rank 0
    writes, every rank agrees. Only the validator sees this view."""

    enabled = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _KeepAll:
    """The store DeePMD's write is handed inside a boundary: it prunes nothing."""

    def prune(self, current: Path) -> None:
        """Retention is the ledger's: files go after the commit that evicted them."""


_KEEP_ALL = _KeepAll()


def _never(path: Path) -> None:
    """DeePMD's ``prune``/``publish``, replaced: the ledger evicts, and the aliases are
    written after each commit from the ledger's latest
    (:meth:`LedgerTrainer._ckptdb_point_aliases`)."""


# ------------------------------------------------------------------ restart


def resolve_restart(
    ledger: IntegrationLedger, spec: str, *, root: Path, aliases: Mapping[str, str]
) -> Checkpoint:
    """The committed, verified checkpoint ``--restart spec`` names, in this run's ledger.

    ``latest``; this run's directory (the run root or the save directory):
    the newest committed checkpoint whose size and hash match its row; a
    prefix or alias (``model.ckpt``, ``model.ckpt.pt``, ``model_ema.ckpt``):
    the newest whole checkpoint of its stream, whatever the alias names; a
    path (``.pt`` added when missing, as DeePMD does): that checkpoint, if
    the ledger has a committed row for it and it is whole. A path with no
    committed row is refused (:class:`CheckpointNotFoundError`) instead of
    loaded. ``aliases`` maps alias file names (relative to ``root``) to their
    streams.
    """
    manager = ledger.manager
    if spec == "latest" and not os.path.lexists(root / spec):
        return _newest(ledger, STREAM, spec)
    path = Path(os.path.abspath(root / Path(spec).expanduser()))
    if path.is_dir():
        if path.resolve() in (root, manager.save_dir):
            return _newest(ledger, STREAM, spec)
        raise InvalidArgumentError(
            f"--restart {spec}: not this run's directory ({root}, checkpoints in "
            f"{manager.save_dir}); ckptdb resumes from this run's ledger only"
        )
    if path.suffix != ".pt":
        path = path.with_name(path.name + ".pt")
    for name, stream in aliases.items():
        if path == Path(os.path.abspath(root / name)):
            return _newest(ledger, stream, spec)
    try:
        return manager.verify(path)
    except CheckpointLostError:
        raise
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"--restart {spec}: {path} has no committed row in this run's ledger "
            f"({root}); ckptdb resumes only from committed checkpoints "
            "(--restart latest takes the newest)"
        ) from exc


def _newest(ledger: IntegrationLedger, stream: str, spec: str) -> Checkpoint:
    found = ledger.newest_whole(stream, log)
    if found is None:
        raise NoCheckpointToResumeError(
            f"--restart {spec}: the ledger has no committed checkpoint of {stream!r} to resume from"
        )
    return found


# --------------------------------------------------------------- the config


def _refuse_unsupported(config: dict[str, Any]) -> None:
    """What this integration does not guard yet is refused before anything is opened."""
    dist = torch.distributed
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    stage = int(config["training"].get("zero_stage", 0) or 0)
    if several and stage > 0:
        raise InvalidArgumentError(
            f"ckptdb's DeePMD-kit integration does not support training.zero_stage={stage} "
            "(sharded optimizer or parameters) yet: train with zero_stage 0 (DDP)"
        )
    if _best_metric(config) is not None:
        root = Path.cwd().resolve()
        best_dir = (root / _best_dir(config)).resolve()
        save_dir = _save_dir(config["training"], root)
        if not best_dir.is_relative_to(save_dir):
            raise InvalidArgumentError(
                f"validating.save_best_dir ({best_dir}) must be inside the save directory "
                f"({save_dir}): ckptdb publishes every checkpoint of a run in its save directory"
            )


def _keep(value: object) -> int | None:
    """DeePMD's keep count as the ledger's ``Keep(last=...)``: below one keeps all."""
    count = int(value)  # type: ignore[call-overload]  # DeePMD's argcheck made it an int
    return count if count >= 1 else None


def _streams(config: dict[str, Any]) -> dict[str, Policy]:
    """``model``: DeePMD's ``max_ckpt_keep`` (or ``ckpt_keep_ratio``);
    ``model_ema``: its ``ema_ckpt_keep`` (default: the same), when EMA is on."""
    params = config["training"]
    keep = params.get("max_ckpt_keep", 5)
    ema_keep = params.get("ema_ckpt_keep")
    ema_keep = keep if ema_keep is None else ema_keep
    ratio = params.get("ckpt_keep_ratio")
    if ratio is not None:
        if params.get("numb_steps") is None:
            raise InvalidArgumentError(
                "training.ckpt_keep_ratio with num_epoch is not yet supported by ckptdb's "
                "DeePMD-kit integration: set max_ckpt_keep (or numb_steps)"
            )
        keep = ema_keep = compat.keep_count_from_ratio(
            ratio, int(params["numb_steps"]), int(params.get("save_freq", 1000))
        )
    streams: dict[str, Policy] = {STREAM: Keep(last=_keep(keep))}
    if params.get("enable_ema"):
        streams[EMA_STREAM] = Keep(last=_keep(ema_keep))
    metric = _best_metric(config)
    if metric is not None:
        validating = config["validating"]
        k = int(validating.get("max_best_ckpt", 1))
        if validating.get("full_validation"):
            streams[BEST_STREAM] = TopK(k, metric, "min")
        if params.get("enable_ema") and validating.get("ema_full_validation"):
            streams[BEST_EMA_STREAM] = TopK(k, metric, "min")
    return streams


def _best_metric(config: Mapping[str, Any]) -> str | None:
    """DeePMD's ``validation_metric`` (lower is better) when validation keeps best
    checkpoints (``full_validation`` or ``ema_full_validation`` with ``save_best``)."""
    validating = config.get("validating") or {}
    full = validating.get("full_validation") or (
        config["training"].get("enable_ema") and validating.get("ema_full_validation")
    )
    if not (full and validating.get("save_best", True)):
        return None
    return str(validating.get("validation_metric", "E:MAE"))


def _best_dir(config: Mapping[str, Any]) -> Path:
    """Where DeePMD writes best checkpoints (``save_best_dir``, else beside ``save_ckpt``)."""
    validating = config.get("validating") or {}
    where = validating.get("save_best_dir")
    return Path(where) if where else Path(config["training"].get("save_ckpt", "model.ckpt")).parent


def _save_dir(params: Mapping[str, Any], root: Path) -> Path:
    """Where DeePMD writes ``model.ckpt-N.pt``: ``save_dir``, else the directory of
    ``save_ckpt`` (as DeePMD's ``build_checkpoint_stores``)."""
    save_dir = params.get("save_dir")
    where = Path(save_dir) if save_dir else Path(params.get("save_ckpt", "model.ckpt")).parent
    return (root / where).resolve()


def _aliases(config: dict[str, Any]) -> dict[str, str]:
    """DeePMD's alias names (relative to the run root) and their streams."""
    prefix = str(config["training"].get("save_ckpt", "model.ckpt"))
    return {prefix + ".pt": STREAM, compat.ema_checkpoint_prefix(prefix) + ".pt": EMA_STREAM}


def _alias_path(store: Any, root: Path) -> Path:
    prefix = Path(store.prefix)
    return root / prefix.parent / (prefix.name + str(store.suffix))
