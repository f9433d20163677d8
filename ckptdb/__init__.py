"""ckptdb: a transactional checkpoint ledger for PyTorch training.

A checkpoint becomes visible only when its ledger row commits, and the row
commits only after a guarded, durable save. The package is laid out by part:
``protocol`` (the boundary state machine, load, reconcile, check, async),
``coord`` (rank agreement), ``ledger`` (all SQL), ``storage`` (where payloads
live) and ``cli`` (the ``ckptdb`` command); :class:`CheckpointManager` is the
façade that composes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import lazy

if TYPE_CHECKING:
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

#: Where each public name lives. They are imported on first use (:mod:`ckptdb.lazy`),
#: so that reading a ledger (``RunReader``, the read-only ``ckptdb`` commands) never
#: pays for importing torch: a cold ``ckptdb latest`` answers in a fraction of
#: the 1.5 s that ``import torch`` takes.
_PUBLIC = {
    "Action": ".protocol.reconcile",
    "Checkpoint": ".record",
    "CheckpointManager": ".manager",
    "CleanupWarning": ".errors",
    "DerivedAlias": ".record",
    "External": ".storage.external",
    "Keep": ".policies",
    "NonFiniteGradGuard": ".guard",
    "OnPreemption": ".preemption",
    "Preempted": ".preemption",
    "Preemption": ".preemption",
    "ReconcileReport": ".protocol.reconcile",
    "Replica": ".record",
    "Replicator": ".replication",
    "RunReader": ".reader",
    "RunRestore": ".recovery",
    "SaveHandle": ".protocol.asyncsave",
    "Sharded": ".storage.dcp",
    "TopK": ".policies",
    "resolve": ".reader",
    "restore_run": ".recovery",
}


if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy.attributes(__name__, _PUBLIC)

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
