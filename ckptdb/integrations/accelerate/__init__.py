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

from typing import TYPE_CHECKING

from .. import lazy

__all__ = ["STREAM", "Checkpoints"]

if TYPE_CHECKING:
    from .checkpoints import STREAM, Checkpoints
else:
    __getattr__, __dir__ = lazy.names(__name__, "checkpoints", __all__)
