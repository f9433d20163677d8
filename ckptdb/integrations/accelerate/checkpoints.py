"""The ckptdb ``Checkpoints`` for Hugging Face Accelerate (see the package docstring).

``save_state``/``load_state`` as ledger boundaries, through the shared
integration layer (:mod:`ckptdb.integrations.common`); rank agreement is
the contract's (:meth:`~ckptdb.integrations.contract.IntegrationLedger.agree`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from .. import common

try:
    from accelerate import Accelerator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise common.framework_missing(
        "ckptdb.integrations.accelerate", "Accelerate", "accelerate"
    ) from exc
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ...errors import ArgumentTypeError, CkptDBError, InvalidArgumentError
from ...guard import NonFiniteGradGuard
from ...policies import Keep, Policy, TopK
from ...preemption import DEFAULT_SIGNALS, Preemption
from ...protocol.inputs import validate_step
from ...record import Checkpoint
from ...storage.external import External
from ..contract import IntegrationLedger, LedgerOptions
from . import compat
from .layout import STREAM, checkpoint_name

__all__ = ["STREAM", "Checkpoints"]

log = logging.getLogger("ckptdb.accelerate")


class Checkpoints:
    """Accelerate's ``save_state``/``load_state``, published and resumed through a ckptdb ledger.

    Each checkpoint is what Accelerate users know: a directory written by
    ``accelerator.save_state`` (``model.safetensors``, ``optimizer.bin``,
    ``scheduler.bin``, ``random_states_<rank>.pkl``, the
    ``register_for_checkpointing`` objects), named ``checkpoint_<step>`` as
    Accelerate's automatic naming names them, read back by
    ``accelerator.load_state``. What decides changes:

    - Visibility is the commit: ``save_state`` writes into a temporary
      directory (``.checkpoint_<step>.ckptdb-tmp-<id>``); once every process
      has reported its part, ckptdb fsyncs and hashes the tree, renames it to
      ``checkpoint_<step>`` and commits one ledger row. A crash before the
      commit leaves a pending row that the next open rolls back with its
      directory.
    - ``resume()`` loads the newest committed checkpoint whose size and hash
      still match its row, never the highest-numbered directory.
    - Retention is the ledger's: a directory is removed only after the commit
      that evicted it, and the checkpoint ``resume()`` loaded is never removed
      while the run is open.
    - The guard: the gradients of every optimizer step the accelerator
      applies (not an accumulation micro-step, not a step the GradScaler
      skipped) are checked on the device; a NaN or Inf since the last
      checkpoint refuses the next one on every process.
    - A taken name (a step saved again, a directory ckptdb does not own) gets
      ``-v1``, ``-v2``...; nothing is written over.
    - The ``metrics`` of each ``save`` are stored with its row and in the
      ledger's ``metrics`` table.

    Construct it after ``accelerator.prepare(...)`` (the guard names the
    prepared models' parameters), on every process: it is collective, and
    only the main process opens the ledger (the writer lock taken, the ledger
    reconciled with the disk). Every process must call ``save`` and
    ``resume`` too, as ``save_state`` itself (never under
    ``if accelerator.is_main_process``); a process that fails a call makes
    every process raise (its own error, the others ``RankFailedError``), and
    ``root`` must be on a filesystem every process sees. It is a context
    manager: leaving it by an exception ends the ledger's attempt as failed.
    A run started without ``resume()`` where checkpoints already are never
    deletes their directories, though they leave the stream. Accelerate's
    ``ProjectConfiguration(automatic_checkpoint_naming=True)`` is refused here
    and at every ``save`` and ``resume``: it would name, pick and delete
    checkpoints behind the ledger (use ``keep_last`` for ``total_limit``).
    Supported: Accelerate ``>=1.15,<2``; another release is refused at import
    (``UnsupportedVersionError``).

    Args:
        accelerator: The ``accelerate.Accelerator`` whose state is saved, after
            ``prepare``.
        root: The run root: it holds the ledger (``ckptdb.sqlite`` and the
            writer lock) and ``checkpoints/checkpoint_<step>/`` (the one ledger
            stream, ``checkpoints``). A local path; created when missing.
        keep_last: How many of the newest committed checkpoints stay (None:
            all). Default 5.
        best: ``(metric, mode)``, e.g. ``("eval_loss", "min")``: the best
            checkpoint by ``metrics[metric]`` (``mode`` ``"min"`` or ``"max"``)
            is kept whatever its age, as one of the ``keep_last`` (the newest is
            always kept too, so ``keep_last=1`` keeps two while the best is
            older; with ``keep_last=None`` every checkpoint is kept, ranked). A
            save without that metric, or with a NaN or infinite value of it
            (left out of the row, with a warning), is allowed and never the
            best. None: no best.
        db_url: The ledger's SQLAlchemy URL, e.g. PostgreSQL (None: SQLite in
            ``root``).
        guard: True (a NaN/Inf gradient refuses the next checkpoint: ``save``
            returns None, logs a warning and records a ``guard_tripped``
            event), ``"raise"`` (``save`` raises ``NonFiniteGradientError``) or
            False (no guard).
        remote: Where a replicator copies the run (``s3://...``), or None: a
            resume whose newest checkpoint is missing or corrupt here brings
            back its copy instead of skipping it, and a new machine resumes
            from the newest copies.
        remote_options: The ``remote`` object store's options (credentials,
            endpoint), with ``remote`` only.
        interval: Seconds between checkpoints, or ``"auto"`` (the Young/Daly
            interval from this run's save cost and failure rate); then
            ``if ckpts.due(step): ckpts.save(step)`` in the loop. None: your own
            schedule decides (report steps with ``heartbeat``).
        min_interval: The shortest interval, in seconds, ``"auto"`` may choose
            (None: 60); with ``interval`` only.
        max_interval: The longest interval, in seconds, ``"auto"`` may choose
            (None: 1800); with ``interval`` only.

    Raises:
        ArgumentTypeError: ``accelerator`` is not an ``Accelerator``, ``root`` is
            not a path, ``best`` is not a ``(metric, mode)`` tuple, or another
            argument has the wrong type.
        InvalidArgumentError: A bad value: an ``s3://`` ``root``, a bad
            ``keep_last``, ``mode``, ``guard``, ``remote`` or interval, or
            Accelerate's automatic checkpoint naming is on.
        LedgerLockedError: Another process trains into ``root``.
        RunDirectoryError: ``root`` cannot hold a run (a file, a read-only
            place).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = 5,
        best: tuple[str, str] | None = None,
        db_url: str | None = None,
        guard: common.GuardSetting = True,
        remote: str | None = None,
        remote_options: Mapping[str, object] | None = None,
        interval: float | str | None = None,
        min_interval: float | None = None,
        max_interval: float | None = None,
    ) -> None:
        if not isinstance(accelerator, Accelerator):
            raise ArgumentTypeError(
                f"accelerator must be an accelerate.Accelerator, got {accelerator!r}"
            )
        if common.check_path(root, "root") is None:
            raise ArgumentTypeError(f"root must be a path, got {root!r}")
        options = LedgerOptions.of(
            db_url=db_url,
            guard=guard,
            remote=remote,
            remote_options=remote_options,
            interval=interval,
            min_interval=min_interval,
            max_interval=max_interval,
        )
        common.check_local_root(root, "root")  # Accelerate writes its own files under root
        policy = _policy(keep_last, best)
        _refuse_automatic_naming(accelerator)
        self.accelerator = accelerator
        self.root = Path(root).resolve()
        self.guard_mode = options.guard
        self.guard = NonFiniteGradGuard(_named_parameters(accelerator)) if options.guard else None
        #: The checkpoint :meth:`resume` loaded (None: this run started afresh).
        self.resumed: Checkpoint | None = None
        self._earlier_protected = False
        self._preemption: Preemption | None = None
        #: The run this object holds (the integration contract).
        self.ledger = IntegrationLedger.open(
            self.root,
            options,
            streams={STREAM: policy},
            save_dir=self.root / STREAM,
            guard=self.guard,
        )
        #: The run's training-loop surface (latest, best, verify, log_metrics).
        self.manager = self.ledger.manager
        self._hook = register_optimizer_step_pre_hook(self._observe) if self.guard else None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._unhook()
        self.ledger.close(exc if exc is not None else None)

    def close(self) -> None:
        """Release the ledger (end the attempt, drop the writer lock) and the guard's hook.

        Leaving the ``with`` block calls it (ending the attempt as failed when
        it is left by an exception). Preemption handlers go with it.

        Raises:
            PublishError: A save still in flight failed and its error was never
                raised.
        """
        self._unhook()
        self.ledger.close()

    def _unhook(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()

    @property
    def save_dir(self) -> Path:
        """Where the ``checkpoint_<step>`` directories are."""
        return self.manager.save_dir

    def preemption(
        self,
        *,
        signals: Iterable[signal.Signals | int] = DEFAULT_SIGNALS,
        grace: float | None = None,
        every: int = 1,
    ) -> Preemption:
        """Treat ``signals`` as a preemption: one agreed checkpoint, then exit; collective.

        ``CheckpointManager.preemption`` for this run. Call
        ``stop.requested(step)`` once per step on every process; when it is
        True (a signal reached any process, and every process agreed on this
        step), ``save(step)`` is the preemption checkpoint: ``save_state``
        within the ``grace`` period, rolled back if the period ends before its
        commit (``save`` then returns None), its outcome recorded in the ledger.
        Then exit with ``sys.exit(stop.exit_code)`` (143 for SIGTERM). The
        handlers go when this object closes.

        Args:
            signals: The signals that mean preemption (default SIGTERM).
            grace: Seconds, counted from the first signal, within which the
                preemption checkpoint must commit (None: no limit).
            every: Under several processes, the agreement runs every this many
                steps (default 1: a signal is acted on within two steps).

        Returns:
            The handle to poll: ``stop.requested(step)``, ``stop.exit_code``.

        Raises:
            InvalidArgumentError: A value that is not a signal, no signal, a
                ``grace`` that is not a positive number of seconds, an ``every``
                below 1, or this run already handles preemption.
            ArgumentTypeError: An argument of the wrong type.
        """
        self._preemption = self.manager.preemption(signals=signals, grace=grace, every=every)
        return self._preemption

    # ------------------------------------------------------------------- saving

    def due(self, step: int) -> bool:
        """Whether to save at ``step``, by the ``interval=`` the run was made with.

        Call it on every process at every step: every process gets the same
        answer at the same call, without a collective per step. It also
        reports the step, so ``ckptdb goodput`` measures the run.

        Args:
            step: The training step just done.

        Returns:
            True when a checkpoint is due: call ``save(step)``.

        Raises:
            InvalidArgumentError: Made without ``interval=``, or ``step`` is not
                a valid step.
        """
        return self.ledger.due(step)

    def heartbeat(self, step: int) -> None:
        """Report that ``step`` is done, where your own schedule decides the saves.

        ``ckptdb goodput`` measures the run from these reports; with
        ``interval=``, ``due`` reports the steps instead.

        Args:
            step: The training step just done.
        """
        self.ledger.heartbeat(step)

    def save(
        self, step: int, *, metrics: Mapping[str, float] | None = None, **save_state_kwargs: Any
    ) -> Checkpoint | None:
        """``accelerator.save_state`` as one ledger boundary.

        Collective: every process calls it with the same ``step``. Each
        process runs ``save_state`` into the same temporary directory and
        reports its outcome; the main process then seals, renames and commits
        it as ``checkpoint_<step>`` (``-v1``... when that name is taken).
        Retention runs in the commit; evicted directories are removed after
        it. ``register_save_state_pre_hook`` hooks receive the temporary
        directory as their ``output_dir``. At the step a preemption was agreed
        on (``preemption``), it is the preemption checkpoint: rolled back if
        the grace period ends before its commit.

        Args:
            step: The training step the checkpoint holds (an int from 0 to
                2**63 - 2), the same on every process.
            metrics: Values stored with the row and in the ledger's ``metrics``
                table; with ``best=``, its metric ranks the checkpoint. None:
                no metrics.
            **save_state_kwargs: Passed to ``accelerator.save_state`` (e.g.
                ``safe_serialization=False``); not ``output_dir``, which ckptdb
                chooses.

        Returns:
            The committed checkpoint (its ``path`` is the ``checkpoint_<step>``
            directory), or None: the guard refused the step (a warning is
            logged and a ``guard_tripped`` event recorded; nothing was written,
            and the step's metrics are kept, written with the next commit), or
            the preemption checkpoint missed its grace period (the last good
            checkpoint stands).

        Raises:
            InvalidArgumentError: A bad ``step``, ``output_dir=`` among the
                arguments, or Accelerate's automatic checkpoint naming switched
                on; on one process only, the others raise ``RankFailedError``.
            RankFailedError: Another process failed its part of the save.
            NonFiniteGradientError: With ``guard="raise"``, a NaN or Inf
                gradient since the previous checkpoint.
            PublishError: The write or the commit failed; nothing was
                published.
        """
        local: CkptDBError | None = None
        try:
            validate_step(step)
            _refuse_keys(save_state_kwargs, "output_dir", "save_state")
            _refuse_automatic_naming(self.accelerator)
        except CkptDBError as exc:
            local = exc
        # a rank that refuses alone must not leave the others in a collective
        self.ledger.agree(local, what="save")
        self._protect_earlier()
        name = self.ledger.free_name(checkpoint_name(step))

        def write(path: Path) -> None:
            self._write(path, save_state_kwargs)

        def boundary() -> Checkpoint | None:
            return self.ledger.publish(
                step,
                STREAM,
                External(write, name),
                metrics=common.rankable_metrics(
                    metrics, self.manager.policies[STREAM], step=step, log=log
                ),
                log=log,
            )

        stop = self._preemption
        if stop is not None and stop.agreed_step == step:
            return stop.publish(step, boundary)
        return boundary()

    def _write(self, path: Path, kwargs: dict[str, Any]) -> None:
        """Every rank's ``save_state`` into ckptdb's temporary path.

        ``save_state`` writes the model and optimizer from the main process and
        each rank's RNG state from that rank, and does not wait for the others;
        ckptdb's boundary does (every rank reports its write before the chief
        seals the directory), also when this rank's save failed.
        """
        self.accelerator.save_state(os.fspath(path), **kwargs)

    def _protect_earlier(self) -> None:
        """A run that did not resume never deletes an earlier run's checkpoints
        (their directories stay, as Accelerate, which refuses to write over them,
        leaves them): once, at its first save."""
        if self._earlier_protected:
            return
        self._earlier_protected = True
        if self.resumed is None:
            self.ledger.start_afresh(STREAM)

    # ------------------------------------------------------------------ resuming

    def resume(self, **load_state_kwargs: Any) -> int | None:
        """``accelerator.load_state`` of the newest committed, whole checkpoint.

        Collective: every process calls it. The candidate is the ledger's
        latest; the main process checks its size and hash against its row
        before any process loads it. One that does not match is marked
        ``corrupt`` (or ``lost``) and skipped with a warning (logger
        ``ckptdb.accelerate``), and the previous one is tried. A directory with
        no ledger row (a partial save, a copy) is never resumed from. The
        loaded checkpoint is protected: retention never removes its directory
        while this run is open; the resume is recorded (a ``resumed`` event)
        and ``resumed`` names it. With a prepared ``DataLoader``, skip the
        batches the checkpoint already saw, as in any Accelerate resume.

        Args:
            **load_state_kwargs: Passed to ``accelerator.load_state`` (e.g.
                ``map_location=...``); not ``input_dir``, which the ledger
                chooses.

        Returns:
            The step of the checkpoint loaded, or None when there is nothing to
            resume from (nothing is loaded).

        Raises:
            InvalidArgumentError: ``input_dir=`` among the arguments, or
                Accelerate's automatic checkpoint naming switched on.
            RankFailedError: Another process failed its part (its arguments, or
                its ``load_state``); the failing process raises its own error.
        """
        local: CkptDBError | None = None
        try:
            _refuse_keys(load_state_kwargs, "input_dir", "load_state")
            _refuse_automatic_naming(self.accelerator)
        except CkptDBError as exc:
            local = exc
        self.ledger.agree(local, what="resume")
        chosen = self.ledger.newest_whole(STREAM, log)
        if chosen is None:
            return None
        problem: Exception | None = None
        try:
            self.accelerator.load_state(os.fspath(chosen.path), **load_state_kwargs)
        except Exception as exc:
            problem = exc
        self.ledger.agree(problem, what="load_state")
        self.ledger.resume_from(chosen)
        self.resumed = chosen
        return chosen.step

    def latest(self) -> Checkpoint | None:
        """The newest committed checkpoint of the run; collective.

        Returns:
            The checkpoint, or None before the first commit.
        """
        return self.manager.latest(STREAM)

    def best(self) -> Checkpoint | None:
        """The best committed checkpoint by ``best=``'s metric; collective.

        Returns:
            The checkpoint, or None without ``best=`` or before a committed save
            carried the metric.
        """
        if not isinstance(self.manager.policies.get(STREAM), TopK):
            return None
        scored = [c for c in self.manager.best(STREAM) if c.metric is not None]
        return scored[0] if scored else None

    # --------------------------------------------------------------------- guard

    def _observe(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Feed the guard the gradients an optimizer step of this accelerator applies.

        A global optimizer pre-hook sees every real ``optimizer.step()``, also
        of optimizers prepared after this object was made; Accelerate calls it
        only when the step is applied (not on an accumulation micro-step, not
        when the GradScaler skips a step that found inf/NaN).
        """
        guard = self.guard
        if guard is None or not any(
            getattr(o, "optimizer", o) is optimizer
            for o in compat.prepared_optimizers(self.accelerator)
        ):
            return
        guard.observe(common.optimizer_params(optimizer))


# ------------------------------------------------------------------------ helpers


def _policy(keep_last: object, best: object) -> Policy:
    """The stream's policy, validated before anything is opened or written."""
    if best is None:
        return Keep(last=keep_last)  # type: ignore[arg-type]  # Keep checks it
    if not (isinstance(best, tuple) and len(best) == 2):
        raise ArgumentTypeError(f"best must be a (metric, mode) tuple, got {best!r}")
    metric, mode = best
    if keep_last is None:  # everything, ranked (last=1 only lets a save omit the metric)
        return TopK(None, metric, mode, last=1)
    return TopK(1, metric, mode, last=keep_last)  # type: ignore[arg-type]  # TopK checks them


def _refuse_automatic_naming(accelerator: Accelerator) -> None:
    """Accelerate's automatic naming must not run beside the ledger.

    With it, ``save_state`` ignores the directory it is given, writes under
    its own iteration counter and deletes old directories past
    ``total_limit`` itself (by name, before the new one is complete), and
    ``load_state()`` picks the highest-numbered directory: each undoes a
    guarantee of the ledger.
    """
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise InvalidArgumentError(
            "ProjectConfiguration(automatic_checkpoint_naming=True) lets Accelerate name, "
            "pick and delete checkpoints itself; ckptdb's Checkpoints does all three through "
            "its ledger (keep_last= replaces total_limit): turn automatic naming off"
        )


def _refuse_keys(kwargs: Mapping[str, Any], key: str, call: str) -> None:
    if key in kwargs:
        raise InvalidArgumentError(
            f"{key}= is chosen by ckptdb (a temporary directory, published at commit); "
            f"pass only the other arguments of {call}"
        )


def _named_parameters(accelerator: Accelerator) -> Iterable[tuple[str, Tensor]]:
    """Parameter names for the guard's report, from the prepared models."""
    models = [accelerator.unwrap_model(m) for m in compat.prepared_models(accelerator)]
    for i, model in enumerate(models):
        prefix = f"{i}." if len(models) > 1 else ""
        for name, param in model.named_parameters():
            yield prefix + name, param
