"""Coordination of ranks: one protocol, a no-op single-process coordinator and a
torch.distributed one (see :mod:`ckptdb.coord.base` and :mod:`ckptdb.coord.dist`)."""

from .base import Coordinator, LocalCoordinator, Objection, Verdict
from .dist import DistCoordinator, RankGroup, coordinator_for

__all__ = [
    "Coordinator",
    "DistCoordinator",
    "LocalCoordinator",
    "Objection",
    "RankGroup",
    "Verdict",
    "coordinator_for",
]
