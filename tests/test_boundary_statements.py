"""The statements of one steady boundary, for every kind of stream and payload.

A statement count is deterministic where time is not, so each kind of stream
(keep the last N, every Nth, all; a top-K, with and without ``last``), each
payload kind (a ``torch.save`` file, a sharded DCP directory, a framework's
own writer) and a run replicated to a remote tier pins its count here, on
SQLite and on PostgreSQL. Every writer run is fenced (one fence statement in
the intent and one in the commit), so each count includes them. A change in
any count must be a deliberate edit of :data:`EXPECTED`, with its reason in
the counts' comment; tests/test_boundary_sql.py pins the 3-stream boundary
the benchmarks time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import state
from sqlalchemy import event

from ckptdb import CheckpointManager, External, Keep, Sharded, TopK
from ckptdb.policies import Policy

Opener = Callable[..., CheckpointManager]

#: Steady-state statements of a one-stream boundary (SQLite, PostgreSQL). On SQLite,
#: "keep last" is: intent 5 (BEGIN, the writer fence, INSERT ... RETURNING, taken
#: names, names), commit 9 (PRAGMA, BEGIN, the writer fence, committed, the retention
#: read, evicted, pins, pointers, metrics), clean-up 3 (PRAGMA, BEGIN, deleted). A
#: PRAGMA runs only where the synchronous level changes from the last transaction's.
#: PostgreSQL has no PRAGMA and no BEGIN statement (its driver begins implicitly) and
#: one pg_notify for followers. Against "keep last":
#: - keep every: two more retention reads (the Nth steps kept), and its intent's PRAGMA;
#: - keep all: nothing evicted (no eviction, no pins read, no clean-up), no names update;
#: - top-k: one more read in the intent (the members, to admit or refuse first);
#: - top-k with last, a sharded directory, an external writer, a replicated run
#:   (``remote=``): the same statements. Replication adds nothing to a boundary: its
#:   copies are the replicator's transactions, and eviction reads the same rows.
EXPECTED: dict[str, dict[str, int]] = {
    "keep last": {"sqlite": 17, "postgresql": 13},
    "keep every": {"sqlite": 20, "postgresql": 15},
    "keep all": {"sqlite": 13, "postgresql": 10},
    "top-k": {"sqlite": 18, "postgresql": 14},
    "top-k with last": {"sqlite": 17, "postgresql": 13},
    "sharded": {"sqlite": 17, "postgresql": 13},
    "external": {"sqlite": 17, "postgresql": 13},
    "replicated": {"sqlite": 17, "postgresql": 13},
}

#: (streams, payload of a step) per kind. The loss improves at every step, so a top-K
#: admits each new checkpoint and evicts its previous member.
KINDS: dict[str, tuple[dict[str, Policy], Callable[[int], Any]]] = {
    "keep last": ({"model": Keep(last=1)}, state),
    "keep every": ({"model": Keep(last=1, every=2)}, state),
    "keep all": ({"model": Keep(last=None)}, state),
    "top-k": ({"model": TopK(1, "loss")}, state),
    "top-k with last": ({"model": TopK(1, "loss", last=1)}, state),
    "sharded": ({"model": Keep(last=1)}, lambda step: Sharded({"w": torch.full((4,), step)})),
    "external": (
        {"model": Keep(last=1)},
        lambda step: External(lambda path: torch.save({"w": step}, path), name=f"e{step}.pt"),
    ),
}
WARM_UP = 6  # boundaries before the one counted: every stream full, evicting


def count_boundary(mgr: CheckpointManager, payload: Callable[[int], Any]) -> list[str]:
    """The first word of each statement of boundary number WARM_UP, after the warm-up."""
    for step in range(WARM_UP):
        mgr.save(step, metrics={"loss": float(-step)}, model=payload(step))
    seen: list[str] = []
    engine = mgr._ctx.ledger.engine

    def on_statement(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement.split()[0].upper())

    event.listen(engine, "before_cursor_execute", on_statement)
    try:
        mgr.save(WARM_UP, metrics={"loss": float(-WARM_UP)}, model=payload(WARM_UP))
    finally:
        event.remove(engine, "before_cursor_execute", on_statement)
    return seen


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_steady_boundary_of_each_kind_runs_its_pinned_statements(
    kind: str, open_manager: Opener, backend: str | None
) -> None:
    streams, payload = KINDS[kind]
    mgr = open_manager(streams=dict(streams))
    seen = count_boundary(mgr, payload)
    name = mgr._ctx.ledger.backend
    assert len(seen) == EXPECTED[kind][name], seen


def test_a_replicated_runs_boundary_runs_its_pinned_statements(
    root: Path, s3_url: str, backend: str | None, open_manager: Opener
) -> None:
    """With ``remote=`` (no replicator running: every evicted checkpoint waits for its copy)."""
    mgr = open_manager(streams={"model": Keep(last=1)}, remote=s3_url)
    seen = count_boundary(mgr, state)
    name = mgr._ctx.ledger.backend
    assert len(seen) == EXPECTED["replicated"][name], seen
