"""Hugging Face Transformers: a ``Trainer`` whose checkpoints become visible at commit.

``from ckptdb.integrations.transformers import Trainer`` (or
``ledger_trainer(SFTTrainer)`` for any ``transformers.Trainer`` subclass) and
train as usual. What changes is what decides:

- **Visibility.** Each ``checkpoint-N/`` is written by the Trainer's own
  savers (model, optimizer, scheduler, scaler, RNG state per rank, trainer
  state) into a temporary directory ckptdb hands out (an
  :class:`~ckptdb.External` payload), fsynced, placed under its usual name
  and committed as one ledger row after every rank has written. No rename
  happens before every rank is done, so no rank can race it.
- **Resume.** ``train(resume_from_checkpoint=True)`` resumes from the newest
  *committed* checkpoint whose size and hash still match, never from the
  highest-numbered directory. A partial ``checkpoint-N`` left by a crash is
  rolled back when the ledger opens.
- **Retention.** ``save_total_limit`` and ``metric_for_best_model`` become the
  policy of the ledger stream ``checkpoints``; the Trainer's own rotation
  never runs, a directory goes only after the commit that evicted it, and
  the checkpoint a run resumed from stays on disk. ``state.best_model_checkpoint``
  (and so ``load_best_model_at_end``) is the ledger's best.
- **The guard** (on unless ``guard=False``): the gradients of every step the
  optimizer applies feed a :class:`~ckptdb.NonFiniteGradGuard`; a non-finite
  one refuses the next checkpoint on every rank and logs a warning
  (``guard="raise"`` stops training instead).
- **Metrics.** Everything the Trainer logs (``state.log_history``) reaches the
  ledger's ``metrics`` table; the evaluation metrics of a step are stored with
  its checkpoint's row.

The ledger lives in ``args.output_dir`` (``ckptdb.sqlite`` beside the
checkpoints) unless ``ledger=`` names another run root; ``db_url=`` puts it in
PostgreSQL.
"""

from typing import TYPE_CHECKING

from .. import lazy

__all__ = ["STREAM", "Trainer", "ledger_trainer", "streams_for"]

if TYPE_CHECKING:
    from .trainer import STREAM, Trainer, ledger_trainer, streams_for
else:
    __getattr__, __dir__ = lazy.names(__name__, "trainer", __all__)
