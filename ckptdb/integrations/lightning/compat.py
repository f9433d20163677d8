"""What the ckptdb ``ModelCheckpoint`` borrows from Lightning's internals, in one place.

Lightning has no public hook that makes a save transactional: its
``ModelCheckpoint`` decides, names, writes and removes checkpoints in private
methods. The ckptdb callback replaces exactly those decisions, so it must
override them. Every private name it uses is here, each with the releases it
was read in and checked against (lightning 2.4.0, 2.5.6 and 2.6.6, the
oldest and newest of which CI runs the integration's tests on):

- :class:`LightningHooks`: Lightning's private save hooks, each forwarded to a
  ckptdb-named method the callback implements, and its private state read or
  set through named properties;
- :func:`dump_checkpoint`: the checkpoint dict as ``trainer.save_checkpoint``
  would write it;
- :func:`check_version`: a release outside the tested range fails at import,
  in one line, before a checkpoint could be written or removed unguarded.

The callback module itself uses only Lightning's public names and these.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from torch import Tensor

from ...errors import ArgumentTypeError
from ..common import check_release, release_of

#: The tested range: the oldest release supported, and the first one that is not.
OLDEST, FIRST_UNSUPPORTED = (2, 4), (2, 7)


def check_version(version: str | None = None) -> str:
    """Lightning's version, or :class:`~ckptdb.errors.UnsupportedVersionError` outside
    the tested range (the callback overrides Lightning's private save hooks; in an
    untested release they may mean something else)."""
    found = str(lightning.__version__ if version is None else version)
    tested = (OLDEST, FIRST_UNSUPPORTED)
    return check_release(
        found,
        tested,
        framework="lightning",
        integration="ckptdb's ModelCheckpoint",
        extra="lightning",
    )


check_version()

#: Lightning 2.5.3 added ``save_on_exception`` (and ``_should_save_on_exception``).
TAKES_SAVE_ON_EXCEPTION = (
    "save_on_exception" in inspect.signature(_LightningModelCheckpoint.__init__).parameters
)
#: Lightning 2.6 writes ``last`` at an epoch or validation end only when a top-k or
#: every-n checkpoint was saved at that step (before: at every one of them).
LAST_ONLY_AFTER_A_SAVE = (release_of(lightning.__version__) or (0, 0)) >= (2, 6)
#: How many leading arguments of ``ModelCheckpoint`` come before ``save_on_exception``.
_BEFORE_SAVE_ON_EXCEPTION = 6


def positional_like_this_release(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` (ckptdb's ``__init__``, in 2.5.3's order: ``save_on_exception`` seventh),
    refusing a seventh positional argument on a release before 2.5.3, where the seventh
    is ``save_weights_only``: the same call must never mean something else here."""
    if TAKES_SAVE_ON_EXCEPTION:
        return init

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > _BEFORE_SAVE_ON_EXCEPTION:
            raise ArgumentTypeError(
                f"on lightning {lightning.__version__}, ModelCheckpoint's seventh argument is "
                "save_weights_only and ckptdb's is save_on_exception (as from 2.5.3): pass "
                "the arguments after save_top_k by keyword"
            )
        init(self, *args, **kwargs)

    return checked


class LightningHooks(_LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` with its private hooks forwarded to ckptdb names.

    The subclass implements ``ckptdb_*`` methods; every Lightning name that
    starts with an underscore stays in this class.
    """

    def __init__(self, *args: Any, save_on_exception: bool = False, **kwargs: Any) -> None:
        if TAKES_SAVE_ON_EXCEPTION:
            super().__init__(*args, save_on_exception=save_on_exception, **kwargs)  # type: ignore[misc]
        else:  # before 2.5.3: the option is ckptdb's (see should_save_on_exception)
            super().__init__(*args, **kwargs)
            self.save_on_exception = save_on_exception

    # ---------------------------------------------------- the hooks, forwarded

    def _save_monitor_checkpoint(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> None:
        self.ckptdb_save_monitored(trainer, candidates)

    def _update_best_and_save(
        self, current: Tensor, trainer: pl.Trainer, candidates: dict[str, Tensor]
    ) -> None:
        self.ckptdb_save_monitored(trainer, {**candidates, str(self.monitor): current})

    def _save_none_monitor_checkpoint(
        self, trainer: pl.Trainer, candidates: dict[str, Tensor]
    ) -> None:
        self.ckptdb_save_unmonitored(trainer, candidates)

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        self.ckptdb_save_other(trainer, filepath)

    def _save_last_checkpoint(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> None:
        self.ckptdb_save_last(trainer, candidates)

    def _get_metric_interpolated_filepath_name(
        self, candidates: dict[str, Tensor], trainer: pl.Trainer, del_filepath: str | None = None
    ) -> str:
        return self.ckptdb_free_filepath(candidates, trainer)

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Never: retention is the ledger's, and a file goes after the commit that evicted it."""

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        return self.ckptdb_last_checkpoints(trainer)

    # ----------------------------------------------- what the subclass implements

    def ckptdb_save_monitored(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def ckptdb_save_unmonitored(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def ckptdb_save_other(self, trainer: pl.Trainer, filepath: str) -> None:
        raise NotImplementedError

    def ckptdb_save_last(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> None:
        raise NotImplementedError

    def ckptdb_free_filepath(self, candidates: dict[str, Tensor], trainer: pl.Trainer) -> str:
        raise NotImplementedError

    def ckptdb_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        raise NotImplementedError

    # ------------------------------------------------ Lightning's private state

    def resolved_dirpath(self, trainer: pl.Trainer) -> Path:
        """Where Lightning puts this callback's checkpoints (``dirpath``, or the one it
        derives from the logger and ``default_root_dir``)."""
        return Path(self._ModelCheckpoint__resolve_ckpt_dir(trainer))  # type: ignore[attr-defined]

    def monitor_candidates(self, trainer: pl.Trainer) -> dict[str, Tensor]:
        """The metrics a file name and the monitor are formatted from, as Lightning makes them."""
        return dict(self._monitor_candidates(trainer))

    def should_save_on_exception(self, trainer: pl.Trainer) -> bool:
        """Lightning's rule for ``save_on_exception`` (2.6's, on every release)."""
        return bool(
            self.save_on_exception
            and not trainer.fast_dev_run  # type: ignore[attr-defined]
            and not trainer.sanity_checking
            and self._last_global_step_saved != trainer.global_step
        )

    def alias_replaced(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        """Whether Lightning would remove ``previous`` now that ``current`` replaces it."""
        return bool(self._should_remove_checkpoint(trainer, previous, current))

    @property
    def version_counter_enabled(self) -> bool:
        return bool(self._enable_version_counter)

    def note_saved(self, step: int, path: str) -> None:
        """Tell Lightning a checkpoint was saved at ``step`` (it skips a second save of
        that step, and decides ``last`` from it)."""
        self._last_global_step_saved = step
        self._last_checkpoint_saved = path


def dump_checkpoint(trainer: pl.Trainer, weights_only: bool) -> dict[str, Any]:
    """The checkpoint dict ``trainer.save_checkpoint`` would write (every rank dumps:
    the strategy may gather)."""
    return dict(trainer._checkpoint_connector.dump_checkpoint(weights_only))
