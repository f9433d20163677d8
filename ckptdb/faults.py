"""Named points in the publication protocol where tests inject crashes and faults.

A no-op hook: production code calls :func:`point` at each phase boundary,
and it does nothing unless a test installed a hook. The crash tests install
one that ``os._exit``s on the n-th visit of one point, proving that a crash
there leaves a run that reconciles to a consistent state.
"""

from __future__ import annotations

from collections.abc import Callable

POINTS = (
    "after_intent",  # pending rows committed; nothing written yet but what every rank
    # writes (Sharded, External), which is written first, inside its collective
    "mid_write",  # inside torch.save, part of the temporary file written
    "after_fsync",  # every temporary file written and fsynced
    "after_replace",  # final names in place, directory not yet fsynced
    "after_fsync_dir",  # directories fsynced, commit not started
    "in_commit",  # inside the commit transaction, before COMMIT
    "after_commit",  # committed, evicted files not yet removed
    "mid_cleanup",  # after the first evicted file was unlinked
    "mid_reconcile",  # reconcile's file work done, ledger not yet updated
)
# Also visited, only by sharded saves (kept out of the sweep over POINTS):
# "mid_shard_write", inside DCP's write step, on every rank. And after every
# writing ledger transaction's COMMIT returned, before its queued work runs:
# "commit_answered" (a test raises a lost connection there: a COMMIT whose
# answer never came).

_hook: Callable[[str], None] | None = None


def point(name: str) -> None:
    if _hook is not None:
        _hook(name)


def set_hook(hook: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Install ``hook`` (None removes it); returns the previous one."""
    global _hook
    previous, _hook = _hook, hook
    return previous
