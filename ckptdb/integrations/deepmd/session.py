"""What both DeePMD-kit PyTorch backends share once a ledger holds their run.

:class:`LedgerTraining` is mixed into each backend's trainer
(:class:`.train.LedgerTrainer` for ``--pt``, :class:`.train_expt.ExptLedgerTrainer`
for ``--pt-expt``): the ledger's opening and closing around DeePMD's loop,
one boundary per DeePMD save, the guard, preemption, the aliases and the
metrics read from DeePMD's log files. A backend class says only how DeePMD
hands it a checkpoint to write.

Several ranks (``torchrun``): DeePMD saves from rank 0 alone, and a ckptdb
boundary is collective, so every boundary starts with the chief's
description of it (:class:`Plan`, :meth:`IntegrationLedger.from_chief`),
which every rank receives at the same point of DeePMD's loop; what rank 0
saves after the loop once training has ended, the other ranks join in
:meth:`LedgerTraining.run`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import (
    CheckpointLostError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    LedgerError,
    NoCheckpointToResumeError,
    NonFiniteGradientError,
    RunDirectoryError,
    SchemaVersionError,
    note_on,
)
from ...guard import NonFiniteGradGuard
from ...preemption import Preemption
from ...reader import RunReader
from ...record import Checkpoint, DerivedAlias
from ...storage.external import External
from .. import common
from ..contract import IntegrationLedger, LedgerOptions
from . import compat, config
from .layout import BEST_EMA_STREAM, BEST_STREAM, EMA_STREAM, POINTER, STREAM
from .logs import LogTail

__all__ = ["PLAN", "LedgerTraining", "Options", "Plan", "Writer", "resolve_restart"]

log = logging.getLogger("ckptdb.deepmd")

#: ckptdb's preemption option (named in the refusal of an optimizer it cannot count).
PREEMPTION_OPTION = "--ckptdb-preemption"
INTERVAL_OPTION = "--ckptdb-interval"
#: The metric-name prefix of each validator's log (``val.log``, ``val_ema.log``).
VAL_PREFIX = {BEST_STREAM: "val_", BEST_EMA_STREAM: "val_ema_"}
#: The name of the collective that shares rank 0's plan of a boundary.
PLAN = "deepmd checkpoint"
#: What DeePMD takes as a file name for ``--restart`` (else a prefix, ``.pt`` added):
#: ``.pt``, and ``--pt-expt``'s ``.pte``/``.pt2``.
RESTART_SUFFIXES = (".pt", ".pte", ".pt2")

#: A write of one checkpoint file to a path ckptdb chooses.
Writer = Callable[[Path], None]


@dataclass(frozen=True)
class Options:
    """What the command line gave ckptdb: the ledger options (guard, preemption, remote,
    db_url) and ``--restart`` as typed."""

    ledger: LedgerOptions = field(default_factory=LedgerOptions)
    restart: str | None = None


@dataclass(frozen=True)
class Plan:
    """One boundary as rank 0 (the rank DeePMD saves from) sees it, for every rank:
    the step, DeePMD's name of each stream's checkpoint (relative to the run's
    save directory, before ckptdb adds a version to a taken one) and the
    boundary's metrics (the validation metric is rank 0's alone)."""

    step: int
    names: dict[str, str]
    metrics: Mapping[str, Any] | None


class LedgerTraining:
    """The ledger's half of a DeePMD-kit trainer (mixed in before DeePMD's class).

    A backend class calls :meth:`_ckptdb_start` from its constructor and
    routes each checkpoint DeePMD writes to :meth:`_ckptdb_publish_periodic`
    or :meth:`_ckptdb_publish_best`.
    """

    # DeePMD's, set by its constructor (both backends)
    ckpt_store: Any
    ema_ckpt_store: Any
    model_ema: Any
    optimizer: Any
    wrapper: Any
    nonfinite_grad_guard: Any
    full_validator: Any
    ema_full_validator: Any
    disp_file: str
    restart_training: bool
    start_step: int
    num_steps: int
    # each backend's compat class (:class:`.compat.HookedTrainer`, ``HookedExptTrainer``)
    deepmd_learning_rate: Callable[[int], float | None]
    deepmd_save_at: Callable[[int], None]
    deepmd_save_freq: Callable[[], int]

    #: Whether a rank other than 0 joins the periodic boundary in DeePMD's guard check
    #: (``--pt``, where DeePMD calls ``save_checkpoint`` on rank 0 alone) rather than
    #: in ``save_checkpoint`` itself (``--pt-expt``, made collective).
    _ckptdb_join_in_guard = True

    def _ckptdb_start(
        self,
        cfg: dict[str, Any],
        options: Options,
        restart_model: str | None,
        construct: Callable[[str | None], None],
    ) -> None:
        """Open the ledger, resolve ``--restart`` through it, ``construct`` DeePMD's
        trainer (with the checkpoint to load), then take over its checkpoints."""
        self.ckptdb = options
        self.run_root = Path.cwd().resolve()  # where DeePMD writes its `checkpoint` pointer
        config.refuse_unsupported(cfg, self.run_root)
        directories = config.stream_directories(cfg, self.run_root)
        save_dir = _save_dir_to_open(self.run_root, options.ledger, directories)
        #: The run this trainer holds (the integration contract).
        self.ledger = IntegrationLedger.open(
            self.run_root, options.ledger, streams=config.streams(cfg), save_dir=save_dir
        )
        #: The run's training-loop surface (latest, best, verify, log_metrics).
        self.manager = self.ledger.manager
        self.resumed: Checkpoint | None = None
        self._ckptdb_refused_step: int | None = None
        self._ckptdb_hook: Any = None
        self._ckptdb_stop: Preemption | None = None
        self._ckptdb_stop_hook: Any = None
        self._ckptdb_steps_done = 0  # this attempt's optimizer steps, counted from start_step
        self._ckptdb_paced_from: int | None = None  # DeePMD's save_freq, while a due save runs
        self._ckptdb_tails: list[LogTail] = []
        try:
            _check_save_dir(self.manager, directories)
            if restart_model is not None:
                spec = options.restart if options.restart is not None else restart_model
                self.resumed = resolve_restart(
                    self.ledger,
                    spec,
                    root=self.run_root,
                    aliases=config.aliases(cfg),
                    directories=directories.values(),
                )
                restart_model = os.fspath(self.resumed.path)
                self.ledger.resume_from(self.resumed)
            else:
                self.ledger.start_afresh()
            construct(restart_model)
            self._ckptdb_take_over()
        except BaseException as exc:
            self._ckptdb_close(exc)
            raise

    def _ckptdb_take_over(self) -> None:
        """After DeePMD's constructor: its retention, aliases and guard become the ledger's."""
        for _, store in self._ckptdb_stores():
            if not store.directory.resolve().is_relative_to(self.manager.save_dir):
                raise InvalidArgumentError(  # pragma: no cover - both read the same keys
                    f"DeePMD writes checkpoints to {store.directory}, outside the ledger's "
                    f"save directory {self.manager.save_dir}"
                )
            # retention is the ledger's; the aliases are written after each commit
            store.prune = _never
            store.publish = _never
        guard_on = bool(self.ckptdb.ledger.guard)
        join = self._ckptdb_join_in_guard and not self.manager.is_chief
        self.nonfinite_grad_guard = _DeepmdGuard(
            self.nonfinite_grad_guard,
            defer=guard_on,
            before_save=self._ckptdb_follow if join else None,
        )
        if guard_on:
            self.manager.guard = NonFiniteGradGuard(self.wrapper.named_parameters())
            self._ckptdb_hook = self.optimizer.register_step_pre_hook(self._observe)
        self._ckptdb_handle_steps()
        self._ckptdb_point_aliases(stale_warning=True)
        self._ckptdb_tails = self._ckptdb_log_tails()

    def _ckptdb_handle_steps(self) -> None:
        """The per-step hook: each step reported (goodput), and with
        ``--ckptdb-interval`` or ``--ckptdb-preemption`` the ranks' agreements on
        when to save (the preemption handlers installed here: collective)."""
        options = self.ckptdb.ledger
        lkf = getattr(self, "opt_type", None) == "LKF"
        asked = ((options.preemption, PREEMPTION_OPTION), (options.interval, INTERVAL_OPTION))
        for wanted, option in asked:
            if wanted is not None and lkf:
                raise InvalidArgumentError(
                    f"{option} needs a torch optimizer: the LKF optimizer's steps cannot be "
                    "counted, so no rank could agree on a step to checkpoint"
                )
        if lkf:
            return  # its steps cannot be counted: goodput counts the attempts unmeasured
        self._ckptdb_steps_done = int(self.start_step)
        if options.preemption is not None:
            self._ckptdb_stop = self.ledger.preemption()
        self._ckptdb_stop_hook = self.optimizer.register_step_post_hook(self._ckptdb_after_step)

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

    def _ckptdb_name(self, path: Path) -> str:
        """DeePMD's path of a checkpoint (relative to the working directory, or
        absolute) as the ledger names it: relative to the run's save directory (its
        directory resolved as the save directory is: a link in the way stays out)."""
        where = self.run_root / path
        return os.path.relpath(where.parent.resolve() / where.name, self.manager.save_dir)

    # ------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """DeePMD's training loop; the ledger's attempt ends with it (failed on an error).

        Once the loop is over, rank 0 may still save (``change_bias_after_training``,
        ``numb_steps: 0``) while the other ranks have nothing left to do: they join
        each such boundary until rank 0 says it is done (a plan of None).
        """
        try:
            super().run()  # type: ignore[misc]  # DeePMD's
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

    def _ckptdb_publish_periodic(
        self, step: int, writers: Mapping[str, Writer]
    ) -> dict[str, Checkpoint] | None:
        """The periodic boundary of ``step`` (rank 0's ``writers``: the regular
        checkpoint's and its EMA twin's, DeePMD's names from its stores); what it
        published (None: refused)."""
        names = {
            stream: self._ckptdb_name(store.path_for(step))
            for stream, store in self._ckptdb_stores()
            if stream in writers
        }
        return self._ckptdb_boundary(Plan(step, names, self._ckptdb_metrics(step)), writers)

    def _ckptdb_follow(self) -> None:
        """A rank other than 0, where it joins the periodic boundary: this rank's
        part of it (rank 0's plan)."""
        self._ckptdb_boundary(None, {})

    def _ckptdb_best_stream(self, path: Path) -> tuple[str, Any, int] | None:
        """The validation-best stream, validator and step of DeePMD's best
        checkpoint ``path`` (``best.ckpt-N.t-R.pt`` in the validator's directory)."""
        for stream, validator in self._ckptdb_validators():
            match = validator.best_checkpoint_pattern.match(path.name)
            if match is not None and path.parent.resolve() == validator.checkpoint_dir.resolve():
                return stream, validator, int(match[1])
        return None

    def _ckptdb_unexpected(self, path: Path) -> InvalidArgumentError:
        return InvalidArgumentError(  # nothing else is written by DeePMD's training loop
            f"ckptdb's DeePMD-kit integration does not publish {path}: only the periodic "
            "and the validation-best checkpoints go through the ledger"
        )

    def _ckptdb_publish_best(self, stream: str, validator: Any, step: int, write: Writer) -> None:
        """A validation-best checkpoint: one boundary of its top-K stream, ranked by
        DeePMD's validation metric, under DeePMD's name without the rank (``-t-R``):
        the ledger ranks, a name never changes. Every rank comes here
        (:class:`_LedgerValidator`); rank 0 alone has evaluated, so its plan is
        everyone's."""
        plan: Plan | None = None
        if self.manager.is_chief:
            value = next(r.metric for r in validator.topk_records if r.step == step)
            metric = self.manager.policies[stream].ranking_metric
            assert metric is not None
            metrics = common.rankable_metrics(
                {**(self._ckptdb_metrics(step) or {}), metric: value},
                self.manager.policies[stream],
                step=step,
                log=log,
            )
            name = self._ckptdb_name(
                validator.checkpoint_dir.resolve()
                / f"{validator.best_checkpoint_prefix}-{step}{validator.best_checkpoint_suffix}"
            )
            plan = Plan(step, {stream: name}, metrics)
        saved = self._ckptdb_boundary(plan, {stream: write})
        if self.manager.is_chief and (saved is None or stream not in saved):
            # refused, or not in the ledger's top-K: DeePMD's own top-K (which decides
            # what it proposes next, and is saved in its checkpoints) drops it too
            validator.topk_records = [r for r in validator.topk_records if r.step != step]
            compat.sync_topk_state(validator)

    def _ckptdb_boundary(
        self, plan: Plan | None, writers: Mapping[str, Writer]
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
            return self._ckptdb_publish_plan(agreed, writers)
        saved = stop.publish(
            agreed.step, lambda: self._ckptdb_publish_plan(agreed, writers, aliases=False)
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
        self, plan: Plan, writers: Mapping[str, Writer], *, aliases: bool = True
    ) -> dict[str, Checkpoint] | None:
        """``publish_all`` of the plan's checkpoints, each written by this rank's writer
        of its stream (none: this rank writes nothing); None when the guard refused
        the step.

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
                self._writer(writers.get(stream)), self.ledger.free_name(name, suffix=".pt")
            )
            for stream, name in plan.names.items()
        }
        saved = self.ledger.publish_all(
            step, payloads, metrics=plan.metrics, log=log, refused=refused
        )
        if aliases and saved is not None and saved.keys() & {STREAM, EMA_STREAM}:
            self._ckptdb_point_aliases()
        return saved

    def _ckptdb_metrics(self, step: int) -> dict[str, float] | None:
        """The metrics of the checkpoint of ``step``: its learning rate."""
        lr = self.deepmd_learning_rate(step)
        return {"lr": lr} if lr is not None else None

    def _writer(self, write: Writer | None) -> Writer:
        """This rank's write of one payload: DeePMD's own (``write``), or nothing on a
        rank that has nothing to write (in a plain, unsharded boundary the chief
        alone writes a file)."""

        def written(target: Path) -> None:
            if write is not None:
                write(target)

        return written

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

    # ------------------------------------------------------ guard, preemption

    def _ckptdb_after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """After each optimizer step, on every rank: the step reported; is a checkpoint
        due (``--ckptdb-interval``); were we told to stop?

        When every rank agrees, DeePMD is made to save a periodic checkpoint at
        the end of this step (:meth:`deepmd_save_at`): the checkpoint is written
        the way DeePMD always writes it, with the scheduler and EMA updates of
        the step in it, and its boundary raises :class:`~ckptdb.Preempted`
        (:meth:`_ckptdb_boundary`). The first step of an attempt is never the
        agreed one: DeePMD never saves at it; nor is the last: a signal then
        lets the finished run end as it does (its final checkpoint is saved
        anyway).
        """
        self._ckptdb_steps_done += 1
        step = self._ckptdb_steps_done  # DeePMD's display step: the checkpoint's number
        if self._ckptdb_paced_from is not None:  # the due save is done: DeePMD's own again
            self.deepmd_save_at(self._ckptdb_paced_from)
            self._ckptdb_paced_from = None
        due = self._ckptdb_due(step)
        stop = self._ckptdb_stop
        edge = step == self.start_step + 1 or step >= self.num_steps
        if stop is None:
            if due and not edge:
                self._ckptdb_save_now(step)
            return
        if stop.agreed_step is not None:  # agreed, and DeePMD went on without saving it
            log.error(
                "ckptdb: DeePMD did not save the preemption checkpoint of step %d; "
                "stopping at step %d without it (the last committed checkpoint stands)",
                stop.agreed_step,
                step,
            )
            raise stop.stop(stop.agreed_step)
        if edge:
            return  # DeePMD never saves at the first step; after the last one training is over
        if stop.requested(step) or due:
            self._ckptdb_save_now(step)

    def _ckptdb_due(self, step: int) -> bool:
        """``--ckptdb-interval``: whether the ledger says this step is due (every rank,
        every step, the same answer); else only the step reported (goodput)."""
        if self.ckptdb.ledger.interval is None:
            self.ledger.heartbeat(step)
            return False
        return self.ledger.due(step)

    def _ckptdb_save_now(self, step: int) -> None:
        """DeePMD saves a periodic checkpoint at the end of ``step``, its way; its own
        ``save_freq`` comes back at the next step."""
        if self._ckptdb_paced_from is None:
            self._ckptdb_paced_from = self.deepmd_save_freq()
        self.deepmd_save_at(step)

    def _observe(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Every optimizer step's gradients, after DeePMD's clipping, to ckptdb's guard
        (on the device: no host sync per step)."""
        guard = self.manager.guard
        if guard is not None:
            guard.observe(common.optimizer_params(optimizer))


def _save_dir_to_open(
    root: Path, options: LedgerOptions, directories: Mapping[str, Path]
) -> Path | None:
    """The save directory to open the run at ``root`` with (None: the one its ledger
    records), before anything is opened.

    An existing run keeps its recorded save directory while that holds every
    stream's directory: the names of its checkpoints keep meaning the same
    files. A configuration that now writes outside it is refused while the run
    holds checkpoints (another save directory would make every one of them
    unreachable, and the open's reconcile would mark them lost); a run that holds
    none may move. A ledger the open must migrate first cannot be read here:
    the recorded save directory is kept, and checked once the run is open
    (:func:`_check_save_dir`).
    """
    try:
        with RunReader(root, db_url=options.db_url) as reader:
            stored, counts = reader.save_dir, reader.state_counts()
    except SchemaVersionError:
        return None
    except LedgerError:  # no ledger or no run here yet (an unreachable one: the open says so)
        return config.ledger_save_dir(directories, root, None)
    if not isinstance(stored, Path):
        return None  # a run on object storage is not a DeePMD layout: opening refuses it
    outside = {s: d for s, d in directories.items() if not d.is_relative_to(stored)}
    if not outside:
        return stored
    held = sum(n for state, n in counts.items() if state not in ("deleted", "aborted"))
    if held:
        raise _moved_out(stored, held, outside)
    return config.ledger_save_dir(directories, root, None)


def _check_save_dir(manager: Any, directories: Mapping[str, Path]) -> None:
    """Once the run is open: every stream's directory lies in its save directory."""
    outside = {s: d for s, d in directories.items() if not d.is_relative_to(manager.save_dir)}
    if outside:
        held = sum(1 for _ in manager.checkpoints())
        raise _moved_out(manager.save_dir, held, outside)


def _moved_out(stored: Path, held: int, outside: Mapping[str, Path]) -> InvalidArgumentError:
    named = ", ".join(f"{stream} in {d}" for stream, d in sorted(outside.items()))
    return InvalidArgumentError(
        f"this run's ledger records {held} checkpoint(s) relative to its save directory "
        f"{stored}, and the configuration now writes outside it ({named}): keep "
        f"validating.save_best_dir and training.save_dir inside {stored} for this run, "
        "or train in a new directory"
    )


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
        """DeePMD calls it on every rank just before a periodic checkpoint is saved: a
        rank other than 0 joins that boundary here (``before_save``, ``--pt``)."""
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


def _never(path: Path) -> None:
    """DeePMD's ``prune``/``publish``, replaced: the ledger evicts, and the aliases are
    written after each commit from the ledger's latest
    (:meth:`LedgerTraining._ckptdb_point_aliases`)."""


def _alias_path(store: Any, root: Path) -> Path:
    prefix = Path(store.prefix)
    return root / prefix.parent / (prefix.name + str(store.suffix))


# ------------------------------------------------------------------ restart


def resolve_restart(
    ledger: IntegrationLedger,
    spec: str,
    *,
    root: Path,
    aliases: Mapping[str, str],
    directories: Collection[Path] = (),
) -> Checkpoint:
    """The committed, verified checkpoint ``--restart spec`` names, in this run's ledger.

    A restart resolves through the ledger, never through the aliases or file
    names, so DeePMD never loads a partial, evicted or refused checkpoint. A
    candidate whose size or hash no longer matches its row is marked
    ``corrupt`` (or ``lost``) and, where the newest is asked for, skipped with
    a warning for the previous one. Collective: every rank gets the chief's
    answer.

    Args:
        ledger: The run, open for training.
        spec: ``--restart`` as typed: ``latest``, or this run's directory (the
            run root, the save directory or a stream's directory), for the
            newest committed checkpoint of ``model`` whose size and hash match
            its row; a prefix or alias (``model.ckpt``, ``model.ckpt.pt``,
            ``model_ema.ckpt``) for the newest whole checkpoint of its stream,
            whatever the alias names; a path (``.pt`` added when it has none of
            ``.pt``, ``.pte``, ``.pt2``, as DeePMD does) for that checkpoint, if
            the ledger has a committed row for it and it is whole. Relative to
            ``root``.
        root: The run root (the working directory DeePMD trains in).
        aliases: Alias file names, relative to ``root``, mapped to their
            streams.
        directories: The streams' directories (the periodic and the best
            checkpoints'); each counts as this run's directory.

    Returns:
        The checkpoint to load.

    Raises:
        InvalidArgumentError: ``spec`` is a directory that is not this run's.
        NoCheckpointToResumeError: ``spec`` names a stream (``latest``, a
            directory, an alias) that has no committed, whole checkpoint.
        CheckpointNotFoundError: ``spec`` is a path with no committed row in
            this run's ledger (a file an earlier run left, an evicted
            checkpoint, one the guard refused): refused instead of loaded.
        CheckpointLostError: The checkpoint at that path is gone (now marked
            ``lost``).
        CorruptCheckpointError: The checkpoint at that path no longer matches
            its row (now marked ``corrupt``).
    """
    manager = ledger.manager
    if spec == "latest" and not os.path.lexists(root / spec):
        return _newest(ledger, STREAM, spec)
    path = Path(os.path.abspath(root / Path(spec).expanduser()))
    if path.is_dir():
        if path.resolve() in {root, manager.save_dir, *directories}:
            return _newest(ledger, STREAM, spec)
        raise InvalidArgumentError(
            f"--restart {spec}: not this run's directory ({root}, checkpoints in "
            f"{manager.save_dir}); ckptdb resumes from this run's ledger only"
        )
    if path.suffix not in RESTART_SUFFIXES:  # a prefix: DeePMD adds ``.pt``
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
