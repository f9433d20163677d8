"""PyTorch Lightning: a drop-in ``ModelCheckpoint`` whose checkpoints become visible at commit.

``from ckptdb.integrations.lightning import ModelCheckpoint`` and use it as
Lightning's own: same arguments, same file names (``filename=``,
``auto_insert_metric_name``, ``-v1`` suffixes), same attributes
(``best_model_path``, ``best_k_models``, ``last_model_path``). What changes is
what decides:

- **Visibility.** Every checkpoint is written by ``trainer.save_checkpoint``
  into a temporary path ckptdb hands out (an :class:`~ckptdb.External`
  payload), fsynced, placed under Lightning's name and committed as one
  ledger row. ``best_model_path``, ``best_k_models`` and ``fit(ckpt_path=
  "last")`` only ever name committed checkpoints.
- **Retention.** Top-k is a ledger stream (``TopK(save_top_k, monitor,
  mode)``; ``Keep`` without a monitor); a file goes only after the commit
  that evicted it. The checkpoint a run resumed from stays on disk.
- **``last.ckpt``** is an alias derived from the ledger: a hard link to the
  newest committed checkpoint, swapped in atomically after the commit and
  rebuilt on resume. ``save_last=True`` writes a checkpoint of its own only
  at a step where no top-k checkpoint was committed.
- **The guard.** With ``guard=True`` the gradients each optimizer step
  applies feed a :class:`~ckptdb.NonFiniteGradGuard` (on the device, no host
  sync); a non-finite one refuses the next checkpoint on every rank
  (``guard="raise"`` also stops training). A step a GradScaler skipped
  changed no weights and does not count.
- **Metrics.** ``trainer.callback_metrics`` at each checkpoint are stored
  with its row and in the ledger's ``metrics`` table.

The ledger lives outside ``dirpath`` (which holds checkpoints only): by
default in ``.<dirpath name>.ckptdb/`` next to it, unique to that
``dirpath``. Several ckptdb callbacks of one Trainer with the same
``dirpath`` share it, each as its own streams.
"""

from typing import TYPE_CHECKING

from .. import lazy

__all__ = ["ModelCheckpoint", "default_ledger", "newest_committed"]

if TYPE_CHECKING:
    from .callback import ModelCheckpoint, default_ledger, newest_committed
else:
    __getattr__, __dir__ = lazy.names(__name__, "callback", __all__)
