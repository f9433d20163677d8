"""ckptdb: a transactional checkpoint ledger for PyTorch training.

A checkpoint becomes visible only when its ledger row commits, and the row
commits only after a guarded, durable save. The package is laid out by part:
``protocol`` (the boundary state machine, load, reconcile, check, async),
``coord`` (rank agreement), ``ledger`` (all SQL), ``storage`` (where payloads
live) and ``cli`` (the ``ckptdb`` command); :class:`CheckpointManager` is the
façade that composes them.
"""

from .errors import CleanupWarning
from .guard import NonFiniteGradGuard
from .manager import CheckpointManager
from .policies import Keep, TopK
from .preemption import OnPreemption, Preempted, Preemption
from .protocol.asyncsave import SaveHandle
from .protocol.reconcile import Action, ReconcileReport
from .reader import RunReader, resolve
from .record import Checkpoint, DerivedAlias, Replica
from .recovery import RunRestore, restore_run
from .replication import Replicator
from .storage.dcp import Sharded
from .storage.external import External

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Checkpoint",
    "CheckpointManager",
    "CleanupWarning",
    "DerivedAlias",
    "External",
    "Keep",
    "NonFiniteGradGuard",
    "OnPreemption",
    "Preempted",
    "Preemption",
    "ReconcileReport",
    "Replica",
    "Replicator",
    "RunReader",
    "RunRestore",
    "SaveHandle",
    "Sharded",
    "TopK",
    "__version__",
    "resolve",
    "restore_run",
]
