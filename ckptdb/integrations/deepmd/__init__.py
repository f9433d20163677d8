"""DeePMD-kit (both PyTorch backends): ``dp --pt train`` / ``dp --pt-expt train``
through a ckptdb ledger.

``python -m ckptdb.integrations.deepmd --pt train input.json`` takes ``dp``'s
arguments and runs DeePMD-kit's own entry point, with its ``Trainer``
replaced by :class:`LedgerTrainer` (``--pt-expt``: :class:`ExptLedgerTrainer`);
every other ``dp`` command (``freeze``, ``test``, ...) is DeePMD's own,
unchanged. The checkpoints stay in the directories DeePMD's configuration
names (:mod:`.config`). DeePMD's habits stay (its file
names ``model.ckpt-<N>.pt`` and ``model_ema.ckpt-<N>.pt``, its
``model.ckpt.pt`` symlink and ``checkpoint`` pointer, ``--restart``), and the
ledger decides:

- **Visibility.** Each periodic save (the regular checkpoint and, with
  ``enable_ema``, its EMA twin) is one ckptdb boundary: both commit or
  neither. The aliases are re-pointed after the commit, atomically, from the
  ledger's latest; ckptdb never reads them.
- **Retention** is the ledger's (``max_ckpt_keep``, ``ema_ckpt_keep``):
  DeePMD's own pruning never runs; a file goes after the commit that evicted it.
- **The guard.** A NaN/Inf gradient since the previous checkpoint refuses the
  next one (a ``guard_tripped`` event, a warning) and training goes on; DeePMD's
  own guard, which would stop the run, defers to it.
- **Resume.** ``--restart latest`` (or a prefix, the run's directory, a
  checkpoint path) loads a committed checkpoint whose size and hash match its
  row; a path with no committed row is refused.

Also ``ckptdb adopt --layout deepmd`` (:mod:`.layout`) for a finished run.
Importing this package (or its layout) does not import DeePMD-kit; using
:class:`LedgerTrainer` or :func:`main` does.
"""

from typing import TYPE_CHECKING

from .. import lazy

__all__ = ["ExptLedgerTrainer", "LedgerTrainer", "check_version", "main", "resolve_restart"]

if TYPE_CHECKING:
    from .train import ExptLedgerTrainer, LedgerTrainer, check_version, main, resolve_restart
else:
    __getattr__, __dir__ = lazy.names(__name__, "train", __all__)
