"""ckptdb: a transactional checkpoint ledger for PyTorch training.

A checkpoint becomes visible only when its ledger row commits, and the row
commits only after a guarded, durable ``torch.save``.
"""

from .guard import NonFiniteGradGuard
from .manager import CheckpointManager, CleanupWarning
from .policies import Keep, TopK
from .reconcile import Action, ReconcileReport
from .record import Checkpoint
from .sharded import Sharded

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Checkpoint",
    "CheckpointManager",
    "CleanupWarning",
    "Keep",
    "NonFiniteGradGuard",
    "ReconcileReport",
    "Sharded",
    "TopK",
    "__version__",
]
