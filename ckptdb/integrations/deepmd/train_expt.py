"""``dp --pt-expt train`` through a ckptdb ledger: DeePMD-kit's ``pytorch-exportable``
backend, with the same boundaries as ``--pt`` (:mod:`.session`).

This backend's trainer runs DeePMD's backend-independent loop, which calls the
public ``save_checkpoint(step)`` for each periodic checkpoint: here that is one
ledger boundary holding the regular checkpoint and its EMA twin, each written
by DeePMD's own serialization to the path the ledger chose. Every rank
enters it (``checkpoint_is_collective``), the way DeePMD has them enter it when
the state is sharded, so the boundary's agreement needs no other meeting
point. A validation-best checkpoint reaches DeePMD's private write, which
:class:`.compat.HookedExptTrainer` hands to :meth:`ExptLedgerTrainer.ckptdb_write_checkpoint`.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

from . import compat
from .layout import EMA_STREAM, STREAM
from .session import LedgerTraining, Options, Writer

__all__ = ["ExptLedgerTrainer"]


class ExptLedgerTrainer(LedgerTraining, compat.HookedExptTrainer):
    """DeePMD-kit's ``--pt-expt`` ``Trainer`` whose checkpoints are ledger boundaries.

    The ``pytorch-exportable`` backend's counterpart of ``LedgerTrainer``, with
    the same streams, names, aliases, guard, metrics, preemption and
    ``--restart`` resolution. You do not construct it: ``main`` has DeePMD-kit's
    own ``get_trainer`` build it in place of
    ``deepmd.pt_expt.train.training.Trainer`` while ``dp --pt-expt train``
    runs. The ledger is opened first, so that ``--restart`` resolves through
    it and DeePMD loads only a committed, verified checkpoint.

    This backend's loop calls the public ``save_checkpoint(step)`` for each
    periodic checkpoint, and every rank enters it: one boundary holding the
    regular checkpoint and its EMA twin, each written by DeePMD's own
    serialization to the path the ledger chose. DeePMD's line ``Saved model
    to ...`` is printed after the commit, with the name published, and not at
    all for a refused step.

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
            (``init_model``, ``finetune_model``...), passed on unchecked.

    Raises:
        InvalidArgumentError: A configuration ckptdb does not support (see
            ``LedgerTrainer``), ``--restart`` naming another run's directory,
            or ``--ckptdb-preemption`` or ``--ckptdb-interval`` with the LKF
            optimizer.
        CheckpointNotFoundError: ``--restart`` names a file with no committed
            row in this run's ledger.
        NoCheckpointToResumeError: ``--restart`` names a stream with no
            committed checkpoint.
        CheckpointLostError: The checkpoint ``--restart`` names is gone.
        CorruptCheckpointError: The checkpoint ``--restart`` names no longer
            matches its row.
        LedgerLockedError: Another process trains in this run.
        RunDirectoryError: The working directory cannot hold a run.
    """

    _ckptdb_join_in_guard = False  # every rank enters save_checkpoint itself

    def __init__(
        self,
        config: dict[str, Any],
        training_data: Any,
        *args: Any,
        ckptdb: Options,
        restart_model: str | None = None,
        **kwargs: Any,
    ) -> None:
        def construct(restart: str | None) -> None:
            deepmds: Any = compat.HookedExptTrainer.__init__  # DeePMD's, untyped
            deepmds(self, config, training_data, *args, restart_model=restart, **kwargs)

        self._ckptdb_start(config, ckptdb, restart_model, construct)

    @property
    def checkpoint_is_collective(self) -> bool:
        """True: every rank enters ``save_checkpoint``, as a ledger boundary is collective.

        Rank 0 writes the files; every rank agrees on the step and the guard's
        verdict.
        """
        return True

    def save_checkpoint(self, step: int) -> None:
        """The periodic checkpoint of ``step`` (and its EMA twin): one ledger boundary.

        DeePMD's loop calls it on every rank. DeePMD's own guard is asked
        first, as DeePMD does (it defers to ckptdb's unless ``--ckptdb-guard
        off``). Rank 0 writes ``model.ckpt-<step>.pt`` (and
        ``model_ema.ckpt-<step>.pt``) with DeePMD's serialization into the
        paths the ledger chose, and both commit or neither; the aliases are
        then re-pointed.

        Args:
            step: The training step to checkpoint.

        Raises:
            NonFiniteGradientError: With ``--ckptdb-guard raise``, a non-finite
                gradient since the previous checkpoint (with ``off``, DeePMD's
                own guard may raise it too).
            PublishError: The write or the commit failed; nothing was published.
            Preempted: This was the preemption checkpoint of the agreed step.
        """
        self.nonfinite_grad_guard.raise_if_nonfinite(self.wrapper.named_parameters)
        if not self.manager.is_chief:  # unsharded: rank 0 alone writes the files
            self._ckptdb_follow()
            return
        writers: dict[str, Writer] = {STREAM: partial(self._ckptdb_save_to, step=step, ema=False)}
        if self.model_ema is not None:
            writers[EMA_STREAM] = partial(self._ckptdb_save_to, step=step, ema=True)
        saved = self._ckptdb_publish_periodic(step, writers)
        if saved is not None and STREAM in saved:  # DeePMD's line, with the name published
            self.deepmd_log_saved(Path(os.path.relpath(saved[STREAM].path, self.run_root)))

    def _ckptdb_save_to(self, target: Path, *, step: int, ema: bool) -> None:
        self.deepmd_save_to(target, step=step, ema=ema)

    def ckptdb_write_checkpoint(self, path: Path, write: Writer) -> None:
        """A checkpoint DeePMD writes outside ``save_checkpoint``: a validation-best one.

        DeePMD's private ``_write_checkpoint`` is forwarded here, on every rank.
        The checkpoint is one boundary of its top-K stream (``best`` or
        ``best_ema``), ranked by rank 0's validation metric and named
        ``best.ckpt-<N>.pt``.

        Args:
            path: DeePMD's path of the best checkpoint (its name decides the
                stream and step).
            write: DeePMD's own write of the checkpoint to a given path.

        Raises:
            InvalidArgumentError: ``path`` is not a validation-best checkpoint of
                this run.
            NonFiniteGradientError: With ``--ckptdb-guard raise``, a non-finite
                gradient since the previous checkpoint.
            PublishError: The write or the commit failed; nothing was published.
        """
        best = self._ckptdb_best_stream(path)
        if best is None:
            raise self._ckptdb_unexpected(path)
        stream, validator, step = best
        self._ckptdb_publish_best(stream, validator, step, write)
