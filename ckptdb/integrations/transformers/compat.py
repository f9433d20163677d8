"""What ckptdb's ``Trainer`` borrows from the Hugging Face Trainer's internals, in one place.

The Trainer has no public hook that makes a save transactional: its
callbacks hear of a checkpoint after it was written and rotated
(``on_save``). ckptdb's Trainer replaces the save itself, so it overrides
the private methods that save, rank and clean up. Every private name it uses
is here, each with the releases it was read in and checked against
(transformers 4.57.6 and 5.25.0, the oldest and newest CI runs the
integration's tests on):

- :class:`TrainerHooks`: the Trainer's private hooks, each forwarded to a
  ``ckptdb_*`` method the ledger Trainer implements, and the private savers
  it calls, under public names;
- :func:`remove_jit_checkpoint`: the SIGTERM handler of the Trainer's own
  just-in-time checkpoint (5.x), taken out;
- :func:`check_version`: a release outside the tested range fails at import,
  in one line.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import transformers

from ..common import check_release

#: The tested range: the oldest release supported, and the first one that is not.
OLDEST, FIRST_UNSUPPORTED = (4, 57), (6, 0)


def check_version(version: str | None = None) -> str:
    """The transformers version, or :class:`~ckptdb.errors.UnsupportedVersionError`
    outside the tested range (the ledger Trainer overrides the Trainer's private save
    methods; in an untested release they may mean something else)."""
    found = str(transformers.__version__ if version is None else version)
    tested = (OLDEST, FIRST_UNSUPPORTED)
    return check_release(
        found,
        tested,
        framework="transformers",
        integration="ckptdb's Trainer",
        extra="transformers",
    )


check_version()

#: 5.x ends training in ``_finalize_training``; 4.57 does the same inline in its training
#: loop, and deletes checkpoints there through ``_sorted_checkpoints``.
ENDS_IN_FINALIZE = hasattr(transformers.Trainer, "_finalize_training")

#: The private methods overridden or called (checked when a class is made).
PRIVATE_METHODS = (
    "_save_checkpoint",
    "_save_optimizer_and_scheduler",
    "_save_scaler",
    "_save_rng_state",
    "_load_best_model",
    "_determine_best_metric",
    "_push_from_checkpoint",
    "_finalize_training" if ENDS_IN_FINALIZE else "_sorted_checkpoints",
)


class TrainerHooks:
    """The Trainer's private hooks forwarded to ``ckptdb_*`` methods; mixed in before a
    ``transformers.Trainer`` (sub)class, so ``super()`` is the Trainer's own."""

    # ------------------------------------------------------ hooks, forwarded

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self.ckptdb_save_checkpoint(model, trial)

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        self.ckptdb_evaluated(metrics)
        return bool(super()._determine_best_metric(metrics, trial))  # type: ignore[misc]

    def _load_best_model(self) -> None:
        self.ckptdb_load_best_model()

    if ENDS_IN_FINALIZE:

        def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
            return self.ckptdb_finalize_training(*args, **kwargs)

    else:

        def _sorted_checkpoints(self, *args: Any, **kwargs: Any) -> list[str]:
            """4.57's end of training deletes what this lists (``save_total_limit=1``),
            and its rotation too: nothing of the ledger's save directory is listed."""
            output_dir = kwargs.get("output_dir", args[0] if args else None)
            if output_dir is not None and self.ckptdb_owns(Path(output_dir)):
                return []
            return list(super()._sorted_checkpoints(*args, **kwargs))  # type: ignore[misc]

    # ------------------------------------------------- what the mixin implements

    def ckptdb_save_checkpoint(self, model: Any, trial: Any) -> None:
        raise NotImplementedError

    def ckptdb_evaluated(self, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def ckptdb_load_best_model(self) -> None:
        raise NotImplementedError

    def ckptdb_finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def ckptdb_owns(self, directory: Path) -> bool:
        raise NotImplementedError

    # -------------------------------------------------- the Trainer's own, named

    def stock_save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's own save (rotation and all)."""
        super()._save_checkpoint(model, trial)  # type: ignore[misc]

    def stock_load_best_model(self) -> None:
        super()._load_best_model()  # type: ignore[misc]

    def stock_finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        return super()._finalize_training(*args, **kwargs)  # type: ignore[misc]

    def save_training_state(self, output_dir: str) -> None:
        """The optimizer, scheduler, scaler and RNG states, as the Trainer's save writes
        them (each rank its RNG state)."""
        trainer: Any = self
        trainer._save_optimizer_and_scheduler(output_dir)
        trainer._save_scaler(output_dir)
        trainer._save_rng_state(output_dir)

    def push_checkpoint(self, path: str) -> None:
        """``push_to_hub``'s upload of one checkpoint directory."""
        trainer: Any = self
        trainer._push_from_checkpoint(path)


def remove_jit_checkpoint(callback: Any) -> None:
    """Put back the SIGTERM handler a ``JITCheckpointCallback`` (5.x's
    ``enable_jit_checkpoint``) replaced, if its own is still installed."""
    jit = getattr(callback, "jit_manager", None)
    if jit is not None and signal.getsignal(signal.SIGTERM) == jit._sigterm_handler:
        signal.signal(signal.SIGTERM, jit._original_sigterm_handler or signal.SIG_DFL)
