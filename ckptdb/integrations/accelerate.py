"""Hugging Face Accelerate: ``save_state`` and ``load_state`` through a ckptdb ledger.

``Checkpoints(accelerator, root)`` keeps Accelerate's habits (one directory
per save, written by ``accelerator.save_state``, named ``checkpoint_<step>``
as Accelerate's automatic naming does, under ``<root>/checkpoints/``) and
hands to the ledger what decides:

- **Visibility.** Each :meth:`Checkpoints.save` is one ckptdb boundary: every
  rank runs ``save_state`` into a temporary directory that ckptdb chose (an
  :class:`~ckptdb.External` payload), every rank reports its write, then
  ckptdb fsyncs the tree, measures and hashes it, renames it to
  ``checkpoint_<step>`` and commits one ledger row. A crash before the commit
  leaves a pending row that the next open rolls back, with its directory.
- **Resume.** :meth:`Checkpoints.resume` loads the newest *committed*
  checkpoint whose size and hash match its row, never the highest-numbered
  directory: a partial or foreign ``checkpoint_<n>`` has no row and is never
  resumed from. That checkpoint is protected for as long as the run is open.
- **Retention** is the ledger's (``Keep(last=keep_last)``; with ``best=``,
  ``TopK(1, metric, mode, last=keep_last)``: ``keep_last`` in all, the best
  and the newest): a directory is removed only after the commit that
  evicted it. Accelerate's own ``total_limit`` deletion cannot run:
  ``automatic_checkpoint_naming`` is refused.
- **The guard.** The gradients of every optimizer step the accelerator
  really applies feed a :class:`~ckptdb.NonFiniteGradGuard` (a step skipped
  by gradient accumulation or by the GradScaler never calls the optimizer,
  so it does not count); a non-finite one refuses the next checkpoint on
  every rank.

Every rank constructs ``Checkpoints`` and calls ``save``/``resume``; only the
chief (rank 0) opens the ledger.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

try:
    from accelerate import Accelerator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ckptdb.integrations.accelerate needs Accelerate: pip install 'ckptdb[accelerate]'"
    ) from exc
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import (
    ArgumentTypeError,
    CheckpointLostError,
    CheckpointNotFoundError,
    CkptDBError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NonFiniteGradientError,
    RankAgreementError,
    RankFailedError,
)
from ..guard import NonFiniteGradGuard
from ..ledger.models import COMMITTED, CORRUPT, DELETING, LOST, PENDING
from ..manager import CheckpointManager, refuse_object_root
from ..policies import Keep, Policy, TopK
from ..record import Checkpoint
from ..storage.external import External

__all__ = ["STREAM", "Checkpoints"]

log = logging.getLogger("ckptdb.accelerate")

#: The one ledger stream; also the save directory's name under the root.
STREAM = "checkpoints"
#: Rows that own their name: ckptdb never publishes over one of them.
_LIVE = (PENDING, COMMITTED, DELETING, LOST, CORRUPT)


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
        guard: bool | Literal["raise"] = True,
    ) -> None:
        if not isinstance(accelerator, Accelerator):
            raise ArgumentTypeError(
                f"accelerator must be an accelerate.Accelerator, got {accelerator!r}"
            )
        if not isinstance(root, (str, os.PathLike)):
            raise ArgumentTypeError(f"root must be a path, got {root!r}")
        if db_url is not None and not isinstance(db_url, str):
            raise ArgumentTypeError(f"db_url must be a str, got {db_url!r}")
        if guard not in (True, False, "raise"):
            raise InvalidArgumentError(f"guard must be True, False or 'raise', got {guard!r}")
        refuse_object_root(root, "root")  # Accelerate writes its own files under root
        policy = _policy(keep_last, best)
        _refuse_automatic_naming(accelerator)
        self.accelerator = accelerator
        self.root = Path(root).resolve()
        self.guard_mode = guard
        self.guard = NonFiniteGradGuard(_named_parameters(accelerator)) if guard else None
        #: The checkpoint :meth:`resume` loaded (None: this run started afresh).
        self.resumed: Checkpoint | None = None
        self._earlier_protected = False
        self.manager = CheckpointManager(
            self.root,
            streams={STREAM: policy},
            save_dir=self.root / STREAM,
            db_url=db_url,
            guard=self.guard,
        )
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
        self.manager.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Release the ledger (end the attempt, drop the writer lock) and the guard's hook."""
        self._unhook()
        self.manager.close()

    def _unhook(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()

    @property
    def save_dir(self) -> Path:
        """Where the ``checkpoint_<step>`` directories are."""
        return self.manager.save_dir

    # ------------------------------------------------------------------- saving

    def save(
        self, step: int, *, metrics: Mapping[str, float] | None = None, **save_state_kwargs: Any
    ) -> Checkpoint | None:
        """``accelerator.save_state`` as one boundary; the committed checkpoint, or None.

        Collective: every rank calls it with the same ``step``. Extra keyword
        arguments go to ``save_state`` (``safe_serialization=False``...). None
        means the guard refused the step (a warning is logged and a
        ``guard_tripped`` event recorded; nothing was written). Retention runs
        in the commit; evicted directories are removed after it.
        """
        local: CkptDBError | None = None
        try:
            _check_step(step)
            _refuse_keys(save_state_kwargs, "output_dir", "save_state")
            _refuse_automatic_naming(self.accelerator)
        except CkptDBError as exc:
            local = exc
        _agree(local)  # a rank that refuses alone must not leave the others in a collective
        live = self.manager.checkpoints(states=_LIVE)
        self._protect_earlier(live)
        name = _free_name(step, live, self.manager.save_dir)

        def write(path: Path) -> None:
            self._write(path, save_state_kwargs)

        try:
            payloads: dict[str, Any] = {STREAM: External(write, name)}
            values = self._rankable(step, metrics)
            saved = self.manager.save(step, metrics=values, blocking=True, **payloads)
        except NonFiniteGradientError as exc:
            if self.guard_mode == "raise":
                raise
            log.warning("ckptdb: step %d was not checkpointed: %s", step, exc)
            return None
        return saved.get(STREAM)

    def _rankable(self, step: int, metrics: Any) -> Any:
        """``metrics`` without a non-finite value of ``best=``'s metric.

        A NaN evaluation loss is an outcome of training, not a mistake in the
        call: the checkpoint is saved, and is never the best (as in the Hugging
        Face Trainer and Lightning). Anything that is not a real number is left
        for ckptdb to refuse with a typed error.
        """
        metric = self.manager.policies[STREAM].ranking_metric
        if metric is None or not isinstance(metrics, Mapping):
            return metrics
        value = metrics.get(metric)
        if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
            value = float(value.item())
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return metrics
        if math.isfinite(value):
            return metrics
        log.warning(
            "ckptdb: step %d: %s is %s; this checkpoint is never the best", step, metric, value
        )
        return {name: v for name, v in metrics.items() if name != metric}

    def _write(self, path: Path, kwargs: dict[str, Any]) -> None:
        """Every rank's ``save_state`` into ckptdb's temporary path.

        ``save_state`` writes the model and optimizer from the main process and
        each rank's RNG state from that rank, and does not wait for the others;
        ckptdb's boundary does (every rank reports its write before the chief
        seals the directory), also when this rank's save failed.
        """
        self.accelerator.save_state(os.fspath(path), **kwargs)

    def _protect_earlier(self, live: list[Checkpoint]) -> None:
        """A run that did not resume never deletes an earlier run's checkpoints.

        Starting afresh in a root that holds checkpoints (a rerun), the new
        timeline evicts them from the stream, but their directories stay on
        disk, as Accelerate (which refuses to write over them) and Lightning
        leave them.
        """
        if self._earlier_protected:
            return
        self._earlier_protected = True
        if self.resumed is not None:
            return
        for record in live:
            if record.stream == STREAM and record.state == COMMITTED:
                self.manager.protect(record)

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
        _agree(local)
        chosen = self._newest_whole()
        if chosen is None:
            return None
        problem: Exception | None = None
        try:
            self.accelerator.load_state(os.fspath(chosen.path), **load_state_kwargs)
        except Exception as exc:
            problem = exc
        _agree(problem)
        self.manager.protect(chosen)
        self.manager.resumed_from(chosen)
        self.resumed = chosen
        return chosen.step

    def _newest_whole(self) -> Checkpoint | None:
        """The newest committed checkpoint whose size and hash match its row.

        ``verify`` (collective: the chief checks, every rank gets the answer)
        marks a mismatch ``corrupt`` or ``lost`` and moves latest back to the
        previous checkpoint, so each turn of the loop is one older candidate.
        """
        while True:
            try:
                return self.manager.verify("latest", stream=STREAM)
            except (CorruptCheckpointError, CheckpointLostError) as exc:
                log.warning("ckptdb: not resuming from it: %s", exc)
            except CheckpointNotFoundError:
                return None

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
            getattr(o, "optimizer", o) is optimizer for o in self.accelerator._optimizers
        ):
            return
        guard.observe([p for group in optimizer.param_groups for p in group["params"]])


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


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise ArgumentTypeError(f"step must be a non-negative int, got {step!r}")
    if step < 0:
        raise InvalidArgumentError(f"step must be >= 0, got {step}")
    return step


def _refuse_keys(kwargs: Mapping[str, Any], key: str, call: str) -> None:
    if key in kwargs:
        raise InvalidArgumentError(
            f"{key}= is chosen by ckptdb (a temporary directory, published at commit); "
            f"pass only the other arguments of {call}"
        )


def _named_parameters(accelerator: Accelerator) -> Iterable[tuple[str, Tensor]]:
    """Parameter names for the guard's report, from the prepared models."""
    models = [accelerator.unwrap_model(m) for m in accelerator._models]
    for i, model in enumerate(models):
        prefix = f"{i}." if len(models) > 1 else ""
        for name, param in model.named_parameters():
            yield prefix + name, param


def _free_name(step: int, live: list[Checkpoint], save_dir: Path) -> str:
    """``checkpoint_<step>``, or ``checkpoint_<step>-v<n>`` when that name is taken.

    Taken by a live row (a re-save of a step, a lost checkpoint) or by
    anything on disk (a checkpoint an earlier run left, a directory planted by
    hand): ckptdb never publishes over a name, and a rerun must not fail.
    """
    held = {os.path.relpath(c.path, save_dir) for c in live}
    name, version = f"checkpoint_{step}", 1
    while name in held or os.path.lexists(save_dir / name):
        name, version = f"checkpoint_{step}-v{version}", version + 1
    return name


# --------------------------------------------------------------------- collectives


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(local: BaseException | None) -> None:
    """Raise on every rank if any rank failed a local step (one all-gather).

    The failing rank raises its own error; the others a
    :class:`~ckptdb.errors.RankFailedError` naming it. Every rank runs the
    same collectives whatever happened locally, so none is left waiting.
    """
    if not _distributed():
        if local is not None:
            raise local
        return
    found: list[Any] = [None] * dist.get_world_size()
    mine = None if local is None else f"{type(local).__name__}: {local}"
    _collective("agree", lambda: dist.all_gather_object(found, mine))
    if local is not None:
        raise local
    failed = [(rank, text) for rank, text in enumerate(found) if text is not None]
    if failed:
        error = RankFailedError("; ".join(f"rank {rank}: {text}" for rank, text in failed))
        error.ranks = [rank for rank, _ in failed]
        raise error


def _collective(name: str, run: Callable[[], object]) -> None:
    """A collective that fails (a rank died, timed out, or never called ``save`` or
    ``resume``: they are collective) raises :class:`~ckptdb.errors.RankAgreementError`."""
    try:
        run()
    except Exception as exc:
        raise RankAgreementError(
            f"rank {dist.get_rank()}: the {name!r} collective of ckptdb's Checkpoints failed "
            "(every rank must call save() and resume(); a rank died or timed out): "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        ) from exc
