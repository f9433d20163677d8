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
    """Accelerate's checkpoints, published and resumed through a ckptdb ledger.

    ``root`` holds the ledger (``ckptdb.sqlite`` and the writer lock, or the
    run's rows in ``db_url``) and ``checkpoints/checkpoint_<step>/``.
    ``keep_last``: how many checkpoints stay (None: all), the newest ones.
    ``best=(metric, mode)`` makes the best one by ``metrics[metric]``
    (``mode`` ``"min"`` or ``"max"``) one of them, whatever its age (the
    newest is always kept too); a save without that metric is allowed and is
    never the best. ``guard``: ``True`` (a NaN/Inf gradient refuses the
    next checkpoint: ``save`` returns None), ``"raise"`` (``save`` raises
    :class:`~ckptdb.errors.NonFiniteGradientError`) or ``False``.
    ``interval``: seconds between checkpoints, or ``"auto"`` (the Young/Daly
    interval from this run's save cost and failure rate, within
    ``min_interval``/``max_interval`` seconds); then ``if checkpoints.due(step):
    checkpoints.save(step)`` in the loop (see docs/goodput.md).

    Construct it after ``accelerator.prepare(...)`` on every rank; a context
    manager (leaving it by an exception ends the ledger's attempt as failed).
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
        """Release the ledger (end the attempt, drop the writer lock) and the guard's hook."""
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
        """Treat ``signals`` (default SIGTERM) as a preemption; collective.

        :meth:`ckptdb.CheckpointManager.preemption` for this run: call
        ``stop.requested(step)`` once per step on every rank; when it is True,
        ``save(step)`` is the preemption checkpoint (``save_state`` within the
        ``grace`` period, its outcome recorded), then exit with
        ``stop.exit_code``. The handlers go when this object closes.
        """
        self._preemption = self.manager.preemption(signals=signals, grace=grace, every=every)
        return self._preemption

    # ------------------------------------------------------------------- saving

    def due(self, step: int) -> bool:
        """Whether to save at ``step`` (``interval=``): every rank, every step, the same
        answer at the same call; it reports the step for ``ckptdb goodput`` too.

        Raises:
            InvalidArgumentError: made without ``interval=``.
        """
        return self.ledger.due(step)

    def heartbeat(self, step: int) -> None:
        """Report that ``step`` is done (goodput) when your own schedule decides saves."""
        self.ledger.heartbeat(step)

    def save(
        self, step: int, *, metrics: Mapping[str, float] | None = None, **save_state_kwargs: Any
    ) -> Checkpoint | None:
        """``accelerator.save_state`` as one boundary; the committed checkpoint, or None.

        Collective: every rank calls it with the same ``step``. Extra keyword
        arguments go to ``save_state`` (``safe_serialization=False``...). None
        means the guard refused the step (a warning is logged and a
        ``guard_tripped`` event recorded; nothing was written). Retention runs
        in the commit; evicted directories are removed after it. At the step a
        preemption was agreed on (:meth:`preemption`), it is the preemption
        checkpoint: rolled back if the grace period ends before its commit
        (then None; the last good checkpoint stands).
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
        """``accelerator.load_state`` of the newest committed, whole checkpoint; its step.

        Collective. The candidate is the ledger's latest; the chief checks its
        size and hash against its row before any rank loads it. One that does
        not match is marked ``corrupt`` (or ``lost``) and skipped with a
        warning, and the previous one is tried. None when there is nothing to
        resume from (nothing is loaded). The loaded checkpoint is protected:
        retention never removes its directory while this run is open. Extra
        keyword arguments go to ``load_state`` (``map_location=...``).
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
        """The newest committed checkpoint (collective)."""
        return self.manager.latest(STREAM)

    def best(self) -> Checkpoint | None:
        """The best committed checkpoint by ``best=``'s metric; None without ``best=``
        or before a save carried the metric (collective)."""
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
