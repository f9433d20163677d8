"""The ckptdb ``Trainer`` for Hugging Face Transformers (see the package docstring).

``ledger_trainer(cls)`` mixes the ledger into any ``transformers.Trainer``
subclass; the boundary itself goes through the shared integration layer
(:mod:`ckptdb.integrations.common`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from .. import common

try:
    import transformers
    from transformers.trainer_callback import ExportableState, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise common.framework_missing(
        "ckptdb.integrations.transformers", "transformers", "transformers"
    ) from exc

from ...errors import (
    ArgumentTypeError,
    CheckpointLostError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    NoCheckpointToResumeError,
    NonFiniteGradientError,
)
from ...guard import NonFiniteGradGuard
from ...policies import Keep, Policy, TopK
from ...preemption import OnPreemption, Preemption
from ...record import Checkpoint
from ...storage.external import External
from ...storage.files import fsync_file
from ..contract import IntegrationLedger, LedgerOptions
from . import compat
from .layout import STREAM, TRAINER_STATE_NAME

__all__ = ["STREAM", "Trainer", "ledger_trainer", "streams_for"]

log = logging.getLogger("ckptdb.transformers")
#: What ckptdb's Trainer overrides or calls: checked when a class is made, so a Trainer
#: class that lacks one (a subclass that deleted it) fails loudly, not silently.
_NEEDED = (*compat.PRIVATE_METHODS, "store_flos", "save_model")
T = TypeVar("T", bound=type)


def best_metric_name(args: Any) -> str | None:
    """The key ``metric_for_best_model`` names in the evaluation metrics (the Trainer's rule)."""
    name = args.metric_for_best_model
    if name is None:
        return None
    return name if name.startswith("eval_") else f"eval_{name}"


def streams_for(args: Any) -> dict[str, Policy]:
    """The ledger stream and retention policy the ledger ``Trainer`` uses for these arguments.

    The Trainer's rotation never runs beside the ledger; its arguments become
    the policy of the one stream, ``checkpoints``, so that a directory is
    removed only after the commit that evicted it:

    - no ``save_total_limit``, no ``metric_for_best_model``: ``Keep(last=None)``,
      everything;
    - ``save_total_limit=N``: ``Keep(last=N)``, the ``N`` newest;
    - ``metric_for_best_model=m`` with ``save_total_limit=N``:
      ``TopK(1, "eval_m", mode, last=N)``: the best, whatever its age, counts
      towards ``N`` as in the Trainer (the best and the ``N-1`` newest when the
      best is older; with ``N=1`` the best and the newest);
    - ``metric_for_best_model=m`` without a limit: ``TopK(None, "eval_m", mode,
      last=1)``, everything, ranked.

    The mode follows ``greater_is_better``, and the metric name is the
    Trainer's (``"accuracy"`` ranks by ``eval_accuracy``). A save without the
    metric, or with a NaN or infinite value of it, is allowed and is never the
    best.

    Args:
        args: The Trainer's ``TrainingArguments`` (``save_total_limit``,
            ``metric_for_best_model`` and ``greater_is_better`` are read).

    Returns:
        The policy by stream name: one entry, ``checkpoints``.
    """
    limit = args.save_total_limit
    last = limit if isinstance(limit, int) and limit > 0 else None
    metric = best_metric_name(args)
    if metric is None:
        return {STREAM: Keep(last=last)}
    mode: Literal["min", "max"] = "max" if args.greater_is_better else "min"
    if last is None:
        return {STREAM: TopK(None, metric, mode, last=1)}  # everything, ranked
    return {STREAM: TopK(1, metric, mode, last=last)}


@dataclass
class _Run:
    """The ledger a ``train()`` call holds, and what the callbacks learned for it."""

    ledger: IntegrationLedger
    guard: NonFiniteGradGuard | None
    evaluated: tuple[int, dict[str, float]] | None = None  # (global step, eval metrics)
    refused_step: int | None = None
    resumed: Checkpoint | None = None
    published: list[Checkpoint] = field(default_factory=list)
    preemption: Preemption | None = None
    preempting: bool = False  # the preemption checkpoint is being written

    def note_evaluation(self, step: int, metrics: Mapping[str, Any]) -> None:
        """The metrics of an evaluation at ``step``, for that step's checkpoint row.

        One step may be evaluated several times (one ``on_evaluate`` per eval
        dataset, a callback evaluating again, the Trainer's own ranking of the
        merged metrics): every value of the step goes with its checkpoint.
        """
        values = dict(common.scalars(metrics, tensors=False))
        if self.evaluated is not None and self.evaluated[0] == step:
            values = {**self.evaluated[1], **values}
        self.evaluated = (step, values)


class _LedgerCallback(TrainerCallback):
    """Feeds the ledger from the Trainer's events: state on train begin, the guard
    before each applied optimizer step, logs and evaluation metrics."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.trainer._ckptdb_run
        if run is not None:
            self.trainer._ckptdb_sync_best(run)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.trainer._ckptdb_run
        if run is None or run.guard is None:
            return
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        run.guard.observe(
            common.optimizer_params(self.trainer.optimizer),
            skipped=common.skipped_by_scaler(scaler),
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """With ``preemption=``: every rank asks, after each optimizer step, whether a
        preemption signal reached any rank; if so, the step is checkpointed and
        ``train`` ends with :class:`~ckptdb.Preempted`."""
        run = self.trainer._ckptdb_run
        stop = run.preemption if run is not None else None
        if stop is not None and stop.requested(state.global_step):
            self.trainer._ckptdb_preempted(run, state.global_step)
        if run is None:
            return
        if self.trainer.ckptdb_options.interval is None:
            run.ledger.heartbeat(state.global_step)
        elif run.ledger.due(state.global_step):  # checkpoint_interval: the Trainer saves now
            control.should_save = True

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        run = self.trainer._ckptdb_run
        if run is not None and metrics is not None:
            run.note_evaluation(state.global_step, metrics)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        run = self.trainer._ckptdb_run
        if run is not None and logs:
            values = dict(common.scalars(logs, tensors=False))
            if values:
                run.ledger.manager.log_metrics(state.global_step, values)


def ledger_trainer(cls: T) -> T:
    """A subclass of ``cls`` whose checkpoints commit through a ckptdb ledger.

    For any ``transformers.Trainer`` subclass (TRL's trainers, your own):
    ``LedgerSFTTrainer = ledger_trainer(SFTTrainer)`` behaves as the ledger
    ``Trainer`` of this module does for ``transformers.Trainer`` itself, and
    takes the same extra keyword arguments (``ledger``, ``db_url``, ``guard``,
    ``preemption``, ``remote``, ``remote_options``, ``checkpoint_interval``,
    ``min_interval``, ``max_interval``: see ``Trainer``). The new class is
    named ``Ledger<cls name>``. A class that is already a ledger Trainer is
    returned as it is.

    Args:
        cls: ``transformers.Trainer`` or a subclass of it.

    Returns:
        The ledger-backed subclass of ``cls``.

    Raises:
        ArgumentTypeError: ``cls`` is not a ``transformers.Trainer`` subclass,
            or it lacks a Trainer method ckptdb overrides or calls (a
            transformers release ckptdb does not support).
    """
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise ArgumentTypeError(
            f"ledger_trainer() takes transformers.Trainer or a subclass, got {cls!r}"
        )
    if issubclass(cls, _LedgerTrainerMixin):
        return cls
    missing = [name for name in _NEEDED if not callable(getattr(cls, name, None))]
    if missing:
        raise ArgumentTypeError(
            f"{cls.__qualname__} lacks {', '.join(missing)}, which ckptdb's Trainer overrides "
            f"or calls: this transformers ({transformers.__version__}) is not one ckptdb "
            "supports (pip install 'ckptdb[transformers]')"
        )
    name = f"Ledger{cls.__name__}"
    made = type(name, (_LedgerTrainerMixin, cls), {"__module__": cls.__module__})
    made.__doc__ = f"{cls.__qualname__} whose checkpoints commit through a ckptdb ledger."
    return made  # type: ignore[return-value]


class _LedgerTrainerMixin(compat.TrainerHooks):
    """The overrides; mixed in before the user's Trainer class by :func:`ledger_trainer`."""

    args: Any
    state: Any
    model: Any
    accelerator: Any
    callback_handler: Any
    control: Any
    hp_search_backend: Any

    def __init__(
        self,
        *args: Any,
        ledger: str | os.PathLike[str] | None = None,
        db_url: str | None = None,
        guard: common.GuardSetting = True,
        preemption: bool | OnPreemption | None = None,
        remote: str | None = None,
        remote_options: Mapping[str, object] | None = None,
        checkpoint_interval: float | str | None = None,
        min_interval: float | None = None,
        max_interval: float | None = None,
        **kwargs: Any,
    ) -> None:
        options = LedgerOptions.of(
            db_url=db_url,
            guard=guard,
            remote=remote,
            remote_options=remote_options,
            preemption=preemption,
            interval=checkpoint_interval,
            min_interval=min_interval,
            max_interval=max_interval,
        )
        common.check_path(ledger, "ledger")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        # the Trainer writes checkpoint-N/ with its own (local) writers: no object storage
        common.check_local_root(getattr(training_args, "output_dir", None), "args.output_dir")
        common.check_local_root(ledger, "ledger")
        if getattr(training_args, "push_to_hub", False) and ledger is None and db_url is None:
            raise InvalidArgumentError(
                "push_to_hub uploads output_dir, and the ledger would be in it (ckptdb.sqlite, "
                "ckptdb.lock, ckptdb.owner): pass ledger= a directory outside output_dir, or "
                "db_url="
            )
        strategy = getattr(training_args, "save_strategy", None)
        if options.interval is not None and getattr(strategy, "value", strategy) == "best":
            raise InvalidArgumentError(
                "checkpoint_interval with save_strategy='best': the Trainer decides its saves "
                "at each evaluation and would drop the due ones; use 'steps' or 'no'"
            )
        super().__init__(*args, **kwargs)
        self.ckptdb_ledger = ledger
        jit = self._ckptdb_without_jit_checkpoint()
        if jit and preemption is False:
            raise InvalidArgumentError(
                "enable_jit_checkpoint=True asks for a checkpoint on SIGTERM and "
                "preemption=False turns it off: pass one of them (with the ckptdb Trainer, "
                "enable_jit_checkpoint means preemption=True)"
            )
        if jit and options.preemption is None:
            # enable_jit_checkpoint: the same, through the ledger
            options = dataclasses.replace(options, preemption=OnPreemption())
        #: The ledger options (``db_url``, ``guard``, ``remote``, ``preemption``), checked.
        self.ckptdb_options = options
        self._ckptdb_run: _Run | None = None
        self.add_callback(_LedgerCallback(self))  # type: ignore[attr-defined]
        self._ckptdb_quiet_refused_saves()

    def _ckptdb_without_jit_checkpoint(self) -> bool:
        """Take out the Trainer's own SIGTERM checkpoint (``enable_jit_checkpoint``),
        handler included; True if it was there.

        It saves on each rank on its own, three seconds after the signal, from
        any of four hooks (one before the optimizer step): ranks can disagree on
        the step, and a collective save then hangs. ckptdb's preemption does the
        same job with the ranks' agreement, through the ledger.
        """
        found = [
            c
            for c in self.callback_handler.callbacks
            if type(c).__name__ == "JITCheckpointCallback"
        ]
        for callback in found:
            compat.remove_jit_checkpoint(callback)
            self.remove_callback(callback)  # type: ignore[attr-defined]
        return bool(found)

    def _ckptdb_quiet_refused_saves(self) -> None:
        """``on_save`` callbacks (the loggers that upload ``checkpoint-<step>``) do not
        hear of a save the guard refused: there is no checkpoint to upload."""
        handler = self.callback_handler
        announce = handler.on_save

        def on_save(args: Any, state: Any, control: Any) -> Any:
            run = self._ckptdb_run
            if run is not None and run.refused_step == state.global_step:
                return control
            return announce(args, state, control)

        handler.on_save = on_save

    # ------------------------------------------------------------------- paths

    @property
    def ckptdb_save_dir(self) -> Path:
        """Where the ``checkpoint-N`` directories are: the Trainer's output directory."""
        return Path(self.args.output_dir).resolve()

    @property
    def ckptdb_root(self) -> Path:
        """The run root that holds the ledger."""
        return Path(self.ckptdb_ledger or self.args.output_dir).resolve()

    def _ckptdb_open(self) -> _Run:
        guard = NonFiniteGradGuard(self.model) if self.ckptdb_options.guard else None
        ledger = IntegrationLedger.open(
            self.ckptdb_root,
            self.ckptdb_options,
            streams=streams_for(self.args),
            save_dir=self.ckptdb_save_dir,
            guard=guard,
        )
        return _Run(ledger, guard)

    # ----------------------------------------------------------------- training

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """The Trainer's ``train``, holding the ledger for its duration.

        The run opens (the writer lock taken, what a crash left reconciled),
        ``resume_from_checkpoint`` resolves through the ledger, and the run
        closes when training ends (as failed if training raised).

        Args:
            resume_from_checkpoint: True: the newest committed checkpoint whose
                size and hash match its row (a mismatched one is marked and the
                previous one taken); a path inside ``output_dir``: that committed
                checkpoint, verified; a path outside it: passed to the Trainer
                as given (a warm start); None or False: start afresh.
            *args: The Trainer's other positional arguments of ``train``.
            **kwargs: The Trainer's other keyword arguments of ``train``.

        Returns:
            What the Trainer's ``train`` returns (a ``TrainOutput``).

        Raises:
            InvalidArgumentError: ``train`` is already running on this Trainer.
            ArgumentTypeError: ``resume_from_checkpoint`` is not a path, a bool
                or None.
            NoCheckpointToResumeError: True with nothing committed, or a path
                inside ``output_dir`` that is not a committed checkpoint.
            LedgerLockedError: Another process trains into this run.
            Preempted: A preemption signal ended training after its checkpoint.
        """
        if self._ckptdb_run is not None:
            raise InvalidArgumentError("train() is already running on this Trainer")
        if not isinstance(resume_from_checkpoint, (str, os.PathLike, bool, type(None))):
            raise ArgumentTypeError(
                f"resume_from_checkpoint must be a path, a bool or None, got "
                f"{resume_from_checkpoint!r}"
            )
        run = self._ckptdb_run = self._ckptdb_open()
        try:
            run.preemption = run.ledger.preemption()
            source = self._ckptdb_resume_source(run, resume_from_checkpoint)
            result = super().train(source, *args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            self._ckptdb_run = None
            run.ledger.close(exc)
            raise
        self._ckptdb_run = None
        run.ledger.close()
        return result

    def _ckptdb_resume_source(
        self, run: _Run, requested: str | os.PathLike[str] | bool | None
    ) -> str | None:
        """What ``train`` resumes from, as the ledger says; protected while this run lasts."""
        if requested is None or requested is False:
            run.ledger.start_afresh(STREAM)
            return None
        if requested is True:
            found = run.ledger.newest_whole(STREAM, log)
            if found is None:
                raise NoCheckpointToResumeError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir}): "
                    "the ledger has no committed checkpoint to resume from"
                )
        else:
            found = self._ckptdb_named(run.ledger, Path(requested))
            if found is None:  # outside this run (a warm start): the user's own files
                run.ledger.start_afresh(STREAM)
                return os.fspath(requested)
        run.ledger.resume_from(found)
        run.resumed = found
        return str(found.path)

    def _ckptdb_named(self, ledger: IntegrationLedger, path: Path) -> Checkpoint | None:
        """The committed checkpoint at ``path`` (verified), None if ``path`` is outside
        the save directory; a path inside it that is not committed is refused, saying
        what the ledger knows of it."""
        resolved = path.resolve()
        if not resolved.is_relative_to(self.ckptdb_save_dir):
            return None
        try:
            return ledger.manager.verify(resolved, stream=STREAM)
        except CheckpointLostError:
            raise
        except CheckpointNotFoundError as exc:
            raise NoCheckpointToResumeError(
                f"{path} is not a committed checkpoint of this run: {ledger.why_not(resolved)}; "
                "resume_from_checkpoint=True takes the newest committed one"
            ) from exc

    # ------------------------------------------------------------------- saving

    def ckptdb_evaluated(self, metrics: dict[str, float]) -> None:
        """The Trainer ranks every evaluation, however it was reached (an ``evaluate()``
        override that tells no callback, a mocked ``_evaluate``): the same metrics go
        with the step's checkpoint row, so the ledger ranks what the Trainer ranks."""
        run = self._ckptdb_run
        if run is not None and isinstance(metrics, Mapping):
            run.note_evaluation(self.state.global_step, metrics)

    def ckptdb_owns(self, directory: Path) -> bool:
        """Whether ``directory`` is the save directory of the ledger run now open."""
        return self._ckptdb_run is not None and directory.resolve() == self.ckptdb_save_dir

    def ckptdb_save_checkpoint(self, model: Any, trial: Any) -> None:
        """One boundary: the Trainer's savers write ``checkpoint-N`` through the ledger."""
        run = self._ckptdb_run
        if run is None or trial is not None:
            if trial is not None:
                log.warning("ckptdb: hyperparameter-search trials are saved without the ledger")
            self.stock_save_checkpoint(model, trial)
            return
        step = self.state.global_step
        if run.refused_step == step:
            return
        if self.hp_search_backend is None:
            self.store_flos()  # type: ignore[attr-defined]
        name = self._ckptdb_free_name(run, step)
        final = self.ckptdb_save_dir / name
        previous = _best_fields(self.state)
        if self.state.best_global_step == step:  # the state saved inside names itself
            self.state.best_model_checkpoint = str(final)

        def write(path: Path) -> None:
            self._ckptdb_write(path)

        def refused(exc: NonFiniteGradientError) -> None:
            run.refused_step = step
            _restore_best_fields(self.state, previous)
            self._ckptdb_sync_best(run)

        try:
            record = run.ledger.publish(
                step,
                STREAM,
                External(write, name),
                metrics=self._ckptdb_metrics(run, step),
                log=log,
                refused=refused,
            )
        except NonFiniteGradientError:
            raise
        except BaseException:  # no collective here: a rank may be failing alone
            _restore_best_fields(self.state, previous)
            raise
        if run.refused_step == step:
            return
        if record is not None:
            run.published.append(record)
        self._ckptdb_sync_best(run)
        if self.args.push_to_hub and record is not None and not run.preempting:
            # (not the preemption checkpoint: an upload does not fit in a grace period)
            self.push_checkpoint(str(record.path))

    def _ckptdb_preempted(self, run: _Run, step: int) -> None:
        """The agreed step's checkpoint (collective), then :class:`~ckptdb.Preempted`.

        The Trainer's usual ``checkpoint-<step>``, written within the grace
        period (``on_step_end`` comes before the step's own save, so there is
        never a second one). Nothing after it runs in the grace period: no
        evaluation, no ``on_save`` upload, no end-of-training load.
        """
        stop = run.preemption
        assert stop is not None

        def boundary() -> list[Checkpoint] | None:
            before = len(run.published)
            run.preempting = True
            self.ckptdb_save_checkpoint(self.model, None)
            return run.published[before:] or None

        saved = stop.publish(step, boundary)
        raise stop.stop(step, saved or [])

    def _ckptdb_free_name(self, run: _Run, step: int) -> str:
        """``checkpoint-N``; ``checkpoint-N-vK`` when that name is taken: by a live row
        (a checkpoint of an abandoned timeline, one whose directory was lost) or by
        anything on disk (a directory that is not ckptdb's)."""
        base = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        return run.ledger.free_name(base, self.ckptdb_save_dir)

    def _ckptdb_write(self, path: Path) -> None:
        """The Trainer's checkpoint, written into ``path`` (every rank its part).

        The same savers, in the same order, as the Trainer's own
        ``_save_checkpoint``, minus its rotation (the ledger evicts) and its
        push (done from the final name, after the commit).
        """
        output_dir = str(path)
        os.makedirs(output_dir, exist_ok=True)
        with ThreadPoolExecutor(1, thread_name_prefix="ckptdb-flush") as flusher:
            self.save_model(output_dir, _internal_call=True)  # type: ignore[attr-defined]
            # the model's files start going to disk while the optimizer is serialized
            flushed = flusher.submit(_flush_files, path)
            if not self.args.save_only_model:
                self.save_training_state(output_dir)
            flushed.result()
        if self.args.should_save:
            handler = self.callback_handler
            for cb in [
                c for c in [*handler.callbacks, self.control] if isinstance(c, ExportableState)
            ]:
                cb_name, cb_state = cb.__class__.__name__, cb.state()
                if isinstance(self.state.stateful_callbacks[cb_name], list):
                    self.state.stateful_callbacks[cb_name].append(cb_state)
                else:
                    self.state.stateful_callbacks[cb_name] = cb_state
            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))

    def _ckptdb_metrics(self, run: _Run, step: int) -> dict[str, float]:
        """The evaluation metrics of this step, for the row (a non-finite ranking metric
        follows :func:`~ckptdb.integrations.common.rankable_metrics`: left out, so that
        checkpoint is never the best, as in the Trainer)."""
        if run.evaluated is None or run.evaluated[0] != step:
            return {}
        policy = run.ledger.manager.policies.get(STREAM)
        return dict(common.rankable_metrics(run.evaluated[1], policy, step=step, log=log) or {})

    def _ckptdb_sync_best(self, run: _Run) -> None:
        """``state.best_*``: the Trainer's own, unless the ledger is better informed.

        The Trainer computes its best from every evaluation, however it was
        reached (an ``evaluate()`` that tells no callback, an evaluation at a
        step that was not saved); ckptdb keeps that. The ledger overrides it
        only where it knows more: a better committed checkpoint than the one
        the Trainer names (a resume from an older checkpoint, whose
        ``trainer_state.json`` predates it), or the Trainer's best checkpoint
        is no longer committed as the Trainer saw it (lost, corrupt, re-saved
        on a new timeline). ``best_model_checkpoint`` is only ever a committed
        checkpoint's path (a re-saved step's ``-v1`` name included).

        Every rank runs the same queries whatever its own state says, and takes
        the chief's answer: ranks never part ways in a collective here.
        """
        if best_metric_name(self.args) is None:
            return
        ledger = run.ledger
        ranked = [c for c in ledger.manager.best(STREAM) if c.metric is not None]
        own = _TrainerBest.of(self.state)
        saved = ledger.committed_at(STREAM, own.step)
        spoiled = ledger.spoiled_at(STREAM, own.step)
        if saved is not None and not ledger.on_this_timeline(saved, run.resumed):
            saved = None  # an earlier run's, or an abandoned branch's: not the Trainer's
        decided = own.reconciled(
            ledger_best=ranked[0] if ranked else None,
            saved=saved,
            spoiled=any(ledger.on_this_timeline(c, run.resumed) for c in spoiled),
            greater_is_better=bool(self.args.greater_is_better),
        )
        ledger.from_chief(decided, what="best").apply(self.state)

    # ------------------------------------------------------------ end of training

    def ckptdb_load_best_model(self) -> None:
        """``load_best_model_at_end``: the ledger's best, verified before it is read."""
        run = self._ckptdb_run
        if run is not None and self.state.best_model_checkpoint is not None:
            verified = run.ledger.manager.verify(
                Path(self.state.best_model_checkpoint), stream=STREAM
            )
            self.state.best_model_checkpoint = str(verified.path)
        self.stock_load_best_model()

    def ckptdb_finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's end of training without its ``save_total_limit == 1`` clean-up
        (which deletes every checkpoint but the best): only the ledger removes files."""
        limit = self.args.save_total_limit
        if self._ckptdb_run is not None:
            self.args.save_total_limit = None
        try:
            return self.stock_finalize_training(*args, **kwargs)
        finally:
            self.args.save_total_limit = limit


def _flush_files(path: Path) -> None:
    """fsync the files written so far under ``path`` (the seal's fsync then finds them
    clean): disk writeback overlaps the next saver's serialization. Only a head start:
    a file another saver renames or removes meanwhile is skipped (the seal fsyncs
    and measures whatever is there in the end)."""
    for file in [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]:
        with contextlib.suppress(FileNotFoundError):
            fsync_file(file)


_BEST_FIELDS = ("best_model_checkpoint", "best_metric", "best_global_step")


@dataclass(frozen=True)
class _TrainerBest:
    """The Trainer's ``state.best_*`` fields, as one value."""

    path: str | None
    metric: float | None
    step: int | None

    @classmethod
    def of(cls, state: Any) -> _TrainerBest:
        return cls(state.best_model_checkpoint, state.best_metric, state.best_global_step)

    def reconciled(
        self,
        *,
        ledger_best: Checkpoint | None,
        saved: Checkpoint | None,
        spoiled: bool,
        greater_is_better: bool,
    ) -> _TrainerBest:
        """This best, as the ledger corrects it.

        ``saved``: the committed checkpoint of this run's timeline at this best's
        step (if any); ``spoiled``: one of this timeline at that step was found
        lost or corrupt since. The ledger's best replaces this one when it is
        better, or when this one is stale (its step's checkpoint holds another
        metric, or went bad). Otherwise the metric and step stay the Trainer's,
        and the path is the committed checkpoint of that step, or, for an
        evaluation that was not saved, the ledger's best.
        """
        stale = spoiled or (saved is not None and saved.metric not in (None, self.metric))
        if ledger_best is not None and (stale or self.outranked_by(ledger_best, greater_is_better)):
            return _TrainerBest(str(ledger_best.path), ledger_best.metric, ledger_best.step)
        if saved is not None:
            return _TrainerBest(str(saved.path), self.metric, self.step)
        if ledger_best is not None:
            return _TrainerBest(str(ledger_best.path), self.metric, self.step)
        return self

    def outranked_by(self, other: Checkpoint, greater_is_better: bool) -> bool:
        """Whether the committed ``other`` is strictly better than this best (or this is
        no best at all)."""
        if self.metric is None or other.metric is None:
            return self.metric is None
        return other.metric > self.metric if greater_is_better else other.metric < self.metric

    def apply(self, state: Any) -> None:
        state.best_model_checkpoint = self.path
        state.best_metric = self.metric
        state.best_global_step = self.step


def _best_fields(state: Any) -> tuple[Any, ...]:
    return tuple(getattr(state, name) for name in _BEST_FIELDS)


def _restore_best_fields(state: Any, values: tuple[Any, ...]) -> None:
    """The Trainer's best, as it was before a save that did not happen."""
    for name, value in zip(_BEST_FIELDS, values, strict=True):
        setattr(state, name, value)


Trainer = ledger_trainer(transformers.Trainer)
"""``transformers.Trainer``, with its checkpoints committed through a ckptdb ledger.

Use it instead of ``transformers.Trainer``: it takes the Trainer's own
arguments, writes the same ``checkpoint-N/`` directories with the Trainer's
own savers (model, optimizer, scheduler, GradScaler, every rank's RNG state,
``trainer_state.json``), and keeps ``push_to_hub`` and the callbacks. What
decides changes:

- A checkpoint becomes visible only when its ledger row commits: the savers
  write into a hidden ``.checkpoint-N.ckptdb-tmp-<id>`` on every rank; ckptdb
  waits for every rank, fsyncs and hashes the tree, renames it to
  ``checkpoint-N`` and commits. A partial directory left by a crash is
  rolled back when the ledger next opens.
- Retention is the ledger's: ``save_total_limit`` and
  ``metric_for_best_model`` become the policy of the stream ``checkpoints``
  (see ``streams_for``), and a directory is removed only after the commit
  that evicted it. The Trainer's rotation and its end-of-training clean-up
  for ``save_total_limit=1`` never run, so the newest checkpoint stays
  beside the best.
- ``state.best_metric`` and ``state.best_global_step`` stay the Trainer's,
  unless the ledger knows better (a resume from an older checkpoint, a best
  checkpoint lost or corrupt); ``state.best_model_checkpoint`` only ever
  names a committed checkpoint, and ``load_best_model_at_end`` verifies it
  before loading.
- A name is never reused: a rerun in the same ``output_dir`` writes
  ``checkpoint-N-v1`` beside an existing ``checkpoint-N``, and never deletes
  the earlier run's directories.
- Every value the Trainer logs goes into the ledger's ``metrics`` table;
  a step's evaluation metrics are stored with its checkpoint row.

Resume: ``train(resume_from_checkpoint=True)`` takes the newest committed
checkpoint whose size and hash still match its row; one that does not is
marked ``corrupt`` (or ``lost``) and the previous one is taken. With nothing
committed it raises ``NoCheckpointToResumeError`` (a ``ValueError``, like the
Trainer's own error). A path inside ``output_dir`` must be a committed
checkpoint (else ``NoCheckpointToResumeError``, saying what the ledger knows
of it); a path outside it is a warm start, passed to the Trainer as given.
The checkpoint resumed from stays on disk while the run trains, and the
resume is recorded. The ledger is open only while ``train`` runs.

Extra keyword arguments, all optional:

- ``ledger``: the run root that holds the ledger (``ckptdb.sqlite``,
  ``ckptdb.lock``); default ``args.output_dir``. A local path. With
  ``push_to_hub``, pass it (outside ``output_dir``) or ``db_url``.
- ``db_url``: the ledger's SQLAlchemy URL, e.g. PostgreSQL; default SQLite in
  the run root.
- ``guard``: True (default: a NaN or Inf gradient refuses the next
  checkpoint, a warning is logged, training goes on and ``on_save``
  callbacks hear nothing), ``"raise"`` (training stops with
  ``NonFiniteGradientError``) or False (no guard).
- ``preemption``: True or an ``OnPreemption(...)``: a SIGTERM on any rank
  becomes the agreed step's ``checkpoint-<step>``, then ``train`` ends with
  ``ckptdb.Preempted`` (exit status 143). The Trainer's
  ``enable_jit_checkpoint=True`` means the same (its own JIT checkpoint is
  taken out); ``preemption=False`` with it is refused.
- ``remote``, ``remote_options``: where a replicator copies the run
  (``s3://...``) and its store's options: a resume whose newest checkpoint is
  missing or corrupt here brings back its copy instead of skipping it.
- ``checkpoint_interval``: seconds, or ``"auto"`` (the Young/Daly interval
  from this run's save cost and failure rate, within ``min_interval`` and
  ``max_interval`` seconds, defaults 60 and 1800): a ``checkpoint-N`` also
  whenever the ledger says one is due, on top of ``save_strategy`` (use
  ``save_strategy="no"`` for the interval alone; ``"best"`` is refused).

Bad extra arguments raise ``InvalidArgumentError`` or ``ArgumentTypeError``
when the Trainer is made, before anything is opened. Every rank constructs
it and calls ``train``; only rank 0 opens the ledger, and a write that fails
on any rank makes every rank raise ``PublishError``, with nothing published.
Hyperparameter-search trials are saved the stock way, outside the ledger.
Supported: transformers ``>=4.57,<6``; another release is refused at import
(``UnsupportedVersionError``). Any other ``Trainer`` subclass gets the same
through ``ledger_trainer``.
"""
