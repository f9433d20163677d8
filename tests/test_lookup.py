"""The load's driver-level lookups (ckptdb/ledger/lookup.py) answer as the ORM did.

``load(step)``, ``load("latest")`` and ``load(path)`` resolve their row with one
plain SQL statement instead of the ORM. What they answer must be exactly what
the ORM's queries answer, every field of the record included (an aware
timestamp, a 64-bit size, a float metric, the boundary's metrics), on SQLite
and PostgreSQL; and a load's statements are counted (deterministic, unlike
time), so a regression to more round trips fails here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import LedgerClient, state, value_of
from sqlalchemy import event, select

from ckptdb import CheckpointManager, Keep, TopK
from ckptdb.ledger import lookup
from ckptdb.ledger import models as m
from ckptdb.ledger import rows as ledger_rows
from ckptdb.record import Checkpoint

Opener = Callable[..., CheckpointManager]
STREAMS = {"model": Keep(last=None), "best": TopK(2, "loss")}


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    """Runs opened here (``open_manager``, ``db``) use both ledgers in turn."""
    return backend


def fields(record: Checkpoint | None) -> dict[str, Any] | None:
    """Every field, those left out of ``==`` (id, attempt, metrics) included."""
    return None if record is None else dataclasses.asdict(record)


def orm_at_step(mgr: CheckpointManager, stream: str, step: int) -> Checkpoint | None:
    return mgr._ctx.queries().find_committed(stream=stream, step=step)


def orm_at_path(mgr: CheckpointManager, rel: str) -> Checkpoint | None:
    return mgr._ctx.queries().find_committed(path=rel)


def orm_latest(mgr: CheckpointManager, stream: str) -> Checkpoint | None:
    ctx = mgr._ctx
    with ctx.ledger.transaction(read=True) as session:
        row = ledger_rows.latest_row(session, ctx.run_id, stream)
        return ledger_rows.to_record(row, ctx.save_dir) if row is not None else None


def looked_up(mgr: CheckpointManager, find: Callable[..., Checkpoint | None], *args: Any) -> Any:
    ctx = mgr._ctx
    with ctx.ledger.transaction(read=True) as session:
        return find(session, ctx.run_id, *args, ctx.save_dir)


def test_every_lookup_answers_what_the_orm_answers(open_manager: Opener, db: LedgerClient) -> None:
    mgr = open_manager(streams=dict(STREAMS))
    for step, loss in enumerate([3.0, 1.0, 2.5, 0.125]):
        mgr.save(
            step, metrics={"loss": loss, "lr": 0.1 * step}, model=state(step), best=state(loss)
        )
    mgr.save(2, model=state(9))  # the same step again: a newer row (the old one deleted)
    # ... both committed, as an adopted or hand-edited ledger may have them: the newest wins
    db.execute("UPDATE checkpoints SET state = 'committed' WHERE stream = 'model' AND step = 2")
    mgr.save(4, model=state(4))  # no metrics at all
    first = mgr.checkpoints("model")[0]
    db.execute("UPDATE checkpoints SET size = ? WHERE id = ?", 5 * 2**31 + 7, first.id)
    bad = mgr.checkpoints("model")[1]
    db.execute("UPDATE checkpoints SET state = 'corrupt' WHERE id = ?", bad.id)
    everything = db.rows("SELECT DISTINCT path FROM checkpoints")
    assert len(everything) >= 8

    for stream in ("model", "best", "nope"):
        for step in range(-1, 6):
            expected = fields(orm_at_step(mgr, stream, step))
            assert fields(looked_up(mgr, lookup.committed_at_step, stream, step)) == expected
        assert fields(looked_up(mgr, lookup.latest, stream)) == fields(orm_latest(mgr, stream))
    for (rel,) in [*everything, ("model/absent.pt",)]:
        expected = fields(orm_at_path(mgr, rel))
        assert fields(looked_up(mgr, lookup.committed_at_path, rel)) == expected

    # what the checks above compared is not all None: the interesting fields are set
    big = looked_up(mgr, lookup.committed_at_step, "model", 0)
    assert big.size == 5 * 2**31 + 7 and big.committed_at.utcoffset() is not None
    assert big.metrics == {"loss": 3.0, "lr": 0.0}
    assert looked_up(mgr, lookup.committed_at_step, "model", 1) is None  # corrupt
    again = looked_up(mgr, lookup.committed_at_step, "model", 2)
    assert again.path.name != "step-000000002.pt" and again.metrics == {}  # the newer row
    best = looked_up(mgr, lookup.latest, "best")
    assert best.metric == 0.125 and best.step == 3


def test_latest_is_none_when_its_pointer_names_a_row_no_longer_committed(
    open_manager: Opener, db: LedgerClient
) -> None:
    mgr = open_manager()
    saved = mgr.save(1, model=state(1))["model"]
    db.execute("UPDATE checkpoints SET state = 'lost' WHERE id = ?", saved.id)
    assert orm_latest(mgr, "model") is None
    assert looked_up(mgr, lookup.latest, "model") is None
    # the pointer does name it: the state is what refuses it
    ctx = mgr._ctx
    with ctx.ledger.transaction(read=True) as session:
        pointer = session.scalars(select(m.Pointer.checkpoint_id)).all()
    assert pointer == [saved.id]


@pytest.fixture
def statements(open_manager: Opener) -> Iterator[tuple[CheckpointManager, list[str]]]:
    """A run of three checkpoints, loaded once (the first load records the resume),
    with a statement counter on its engine."""
    mgr = open_manager()
    for step in range(3):
        mgr.save(step, model=state(step))
    mgr.load()
    seen: list[str] = []
    engine = mgr._ctx.ledger.engine

    def on_statement(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement.split()[0].upper())

    event.listen(engine, "before_cursor_execute", on_statement)
    yield mgr, seen
    event.remove(engine, "before_cursor_execute", on_statement)


@pytest.mark.parametrize("which", ["latest", 1, "path"])
def test_a_load_reads_the_ledger_with_one_query(
    statements: tuple[CheckpointManager, list[str]], which: Any
) -> None:
    mgr, seen = statements
    if which == "path":
        which = mgr.checkpoints("model")[1].path
        seen.clear()
    expected = 2.0 if which == "latest" else 1.0
    assert value_of(mgr.load(which)) == expected
    # SQLite: its read transaction's BEGIN, then the one SELECT; PostgreSQL: the driver
    # begins implicitly (a read-only transaction: one SET)
    assert seen.count("SELECT") == 1, seen
    assert len(seen) <= 3, seen
