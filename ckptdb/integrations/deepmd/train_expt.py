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

    Constructed by DeePMD's own ``get_trainer`` in place of its ``Trainer``
    (:func:`.compat.trainer_replaced_by`); the ledger is opened first, so that
    ``--restart`` is resolved through it.
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
        """Every rank enters ``save_checkpoint``: a ledger boundary is collective (rank 0
        writes the files, every rank agrees on the step and the guard's verdict)."""
        return True

    def save_checkpoint(self, step: int) -> None:
        """The periodic checkpoint of ``step`` (and its EMA twin): one boundary.

        DeePMD's own guard is asked first, as DeePMD does (it defers to ckptdb's
        unless ``--ckptdb-guard off``)."""
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
        """A checkpoint DeePMD writes outside ``save_checkpoint``: a validation-best one
        (every rank comes here, :class:`.session._LedgerValidator`)."""
        best = self._ckptdb_best_stream(path)
        if best is None:
            raise self._ckptdb_unexpected(path)
        stream, validator, step = best
        self._ckptdb_publish_best(stream, validator, step, write)
