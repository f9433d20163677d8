"""What the ledger cannot hold, and the edges of the paths that write it fast.

A step or a metric name a ledger cannot store is bad input, refused before
anything is buffered: once buffered, it failed every later flush, commit and
close of the run. Also here: an interrupt inside a driver-level statement
invalidates its connection (as SQLAlchemy does), and the metric buffer's
training-thread appends and background drops lose and repeat nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import LedgerClient

from ckptdb import CheckpointManager, Keep, NonFiniteGradGuard, TopK
from ckptdb.errors import InvalidArgumentError

Opener = Callable[..., CheckpointManager]


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


def test_a_step_the_ledger_cannot_hold_is_bad_input_and_poisons_nothing(
    open_manager: Opener, db: LedgerClient
) -> None:
    """Steps are 64-bit on both backends (PostgreSQL's were 32-bit before revision
    0003, and a step past 2**31 - 1 was buffered by log_metrics, then failed every
    flush and commit of the run). Past 2**63 - 2 a step is bad input, never buffered."""
    mgr = open_manager()
    mgr.log_metrics(1, {"loss": 0.5})
    held = (2**31 - 1, 2**31, 2**40, 2**63 - 2)
    for step in held:
        mgr.log_metrics(step, {"loss": 0.25})
    with pytest.raises(InvalidArgumentError, match=r"at most 2\*\*63 - 2"):
        mgr.log_metrics(2**63 - 1, {"loss": 0.25})
    assert len(mgr._ctx.metrics) == 1 + len(held)  # nothing buffered
    mgr.flush()
    got = db.rows("SELECT step, name, value FROM metrics ORDER BY id")
    assert got == [(1, "loss", 0.5)] + [(s, "loss", 0.25) for s in held]


def test_a_save_at_a_step_the_ledger_cannot_hold_records_nothing(
    open_manager: Opener, db: LedgerClient
) -> None:
    """save() past the bound is bad input before its metrics are buffered; at the
    bound itself (64 bits, on both backends) the checkpoint commits, loads and shows
    in the views."""
    mgr = open_manager()
    limit = 2**63 - 2  # so that attempt_summary's steps lost (limit + 1) fits in 64 bits
    with pytest.raises(InvalidArgumentError):
        mgr.save(limit + 1, metrics={"loss": 0.5}, model={"w": torch.zeros(2)})
    assert len(mgr._ctx.metrics) == 0
    mgr.save(2**31, metrics={"loss": 0.5}, model={"w": torch.ones(2)})
    mgr.save(limit, metrics={"loss": 0.25}, model={"w": torch.zeros(2)})
    assert db.rows("SELECT step, value FROM metrics ORDER BY step") == [
        (2**31, 0.5),
        (limit, 0.25),
    ]
    assert db.rows("SELECT step FROM latest_checkpoints") == [(limit,)]
    assert torch.equal(mgr.load(2**31, stream="model")["w"], torch.ones(2))
    assert mgr.latest().step == limit


def test_the_steps_a_crash_lost_are_counted_at_the_largest_step(
    open_manager: Opener, db: LedgerClient
) -> None:
    """attempt_summary counts a crashed attempt's lost steps as its last step + 1 when
    nothing committed: at 2**63 - 1 that overflowed, and PostgreSQL refused the
    whole view, for every run in the database."""
    mgr = open_manager()
    mgr.log_metrics(2**63 - 2, {"loss": 0.5})
    mgr.close()
    db.execute("UPDATE attempts SET end_state = 'crashed'")
    assert db.rows("SELECT last_step_seen, steps_lost FROM attempt_summary") == [
        (2**63 - 2, 2**63 - 1)
    ]


def test_a_policy_at_the_64_bit_maximum_is_stored_and_read_back(
    open_manager: Opener, db: LedgerClient
) -> None:
    """A policy's numbers fit the ledger's 64-bit columns (PostgreSQL's were 32-bit
    before revision 0003, and the run could not be recorded at open); one stored at
    the maximum is read back at the next open, with no streams given."""
    most = 2**63 - 1
    first = open_manager(streams={"best": TopK(most, "loss"), "model": Keep(last=most)})
    first.save(1, metrics={"loss": 0.5}, best={"w": torch.ones(1)}, model={"w": torch.ones(1)})
    first.close()
    again = open_manager(streams=None)
    assert again.policies == {"best": TopK(most, "loss"), "model": Keep(last=most)}
    assert db.rows("SELECT k FROM streams WHERE name = 'best'") == [(most,)]


@pytest.mark.parametrize(
    "name", ["n" * 256, "nul\x00name", "lone\ud800surrogate"], ids=["too-long", "nul", "surrogate"]
)
def test_a_metric_name_the_ledger_cannot_hold_is_bad_input_and_poisons_nothing(
    open_manager: Opener, db: LedgerClient, name: str
) -> None:
    """``metrics.name`` is VARCHAR(255), and PostgreSQL's text holds no NUL: such a
    name was buffered, then every flush and commit of the run failed on it."""
    mgr = open_manager()
    mgr.log_metrics(1, {"loss": 0.5})
    with pytest.raises(InvalidArgumentError):
        mgr.log_metrics(2, {"ok": 1.0, name: 2.0})
    with pytest.raises(InvalidArgumentError):
        mgr.save(3, metrics={"ok": 1.0, name: 2.0}, model={"w": torch.zeros(2)})
    assert len(mgr._ctx.metrics) == 1
    mgr.flush()
    assert db.rows("SELECT step, name, value FROM metrics ORDER BY id") == [(1, "loss", 0.5)]


@pytest.mark.parametrize("many", [False, True], ids=["execute", "executemany"])
def test_an_interrupt_mid_statement_invalidates_the_connection_as_sqlalchemy_does(
    many: bool,
) -> None:
    """``exec_driver_sql`` invalidates the connection on an exit exception (Ctrl-C
    mid-statement: its protocol state is unknown); the driver runner kept it for the pool."""
    from sqlalchemy import create_engine, event

    from ckptdb.ledger import driver

    def invalidated(run: Callable[[Any], object]) -> bool:
        engine = create_engine("sqlite://")
        with engine.connect() as c:
            c.exec_driver_sql("CREATE TABLE t (x INTEGER)")

            def interrupt(*args: Any) -> None:
                raise KeyboardInterrupt

            event.listen(c, "before_cursor_execute", interrupt)
            with pytest.raises(KeyboardInterrupt):
                run(c)
            return c.invalidated

    rows = [(1,), (2,)]
    sql = "INSERT INTO t VALUES (?)"
    assert invalidated(lambda c: c.exec_driver_sql(sql, rows if many else rows[0]))
    if many:
        assert invalidated(lambda c: driver.executemany(c, sql, iter(rows)))
    else:
        assert invalidated(lambda c: driver.execute(c, sql, rows[0]))


def test_a_step_past_the_ledgers_bound_does_not_reset_a_tripped_guard(
    open_manager: Opener, db: LedgerClient, backend: str | None
) -> None:
    """Bad input is checked before the guard, which a typo must not reset."""
    past = 2**63
    guard = NonFiniteGradGuard()
    mgr = open_manager(guard=guard)
    guard.update(torch.tensor(float("nan")))
    with pytest.raises(InvalidArgumentError):
        mgr.save(past, model={"w": torch.zeros(2)})
    assert guard.tripped() is True


def test_names_off_the_ascii_fast_path_still_log(open_manager: Opener, db: LedgerClient) -> None:
    """A non-ASCII name (checked by validate_metrics, not the fast path) is stored as is,
    and 255 characters is still a name."""
    mgr = open_manager()
    mgr.log_metrics(1, {"损失": 0.5, "é" * 255: 1.5, "n" * 255: 2.5})
    mgr.flush()
    got = db.rows("SELECT name, value FROM metrics ORDER BY id")
    assert got == [("损失", 0.5), ("é" * 255, 1.5), ("n" * 255, 2.5)]


def test_a_background_drop_and_the_training_threads_calls_lose_and_repeat_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One thread logs calls of 1-4 points while another inserts prefixes of any size
    (ending inside calls) and drops them, as a background commit does: every point is
    inserted once, in order (checked: it held; kept as a regression test)."""
    import random
    import sys
    import threading

    from ckptdb.protocol import context

    inserted: list[tuple[int, str, float]] = []

    def insert(_s: Any, _r: int, _a: int, steps: Any, values: Any, walls: Any) -> None:
        inserted.extend((s, n, x) for s, v in zip(steps, values, strict=True) for n, x in v.items())

    monkeypatch.setattr(context.ledger_rows, "insert_metric_calls", insert)
    buffer = context.MetricBuffer()
    logged: list[tuple[int, str, float]] = []
    done = threading.Event()
    rng = random.Random(4)

    def training() -> None:
        for i in range(5000):
            values = {f"m{j}": float(i) for j in range(1 + i % 4)}
            logged.extend((i, n, x) for n, x in values.items())
            buffer.add(i, values)
        done.set()

    def committing() -> None:
        while not done.is_set():
            limit = rng.randint(0, 20) if rng.random() < 0.9 else None
            buffer.drop(buffer.insert_into(None, 1, 1, limit))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=training), threading.Thread(target=committing)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    buffer.drop(buffer.insert_into(None, 1, 1, None))
    assert inserted == logged and len(buffer) == 0 and buffer.entries == []
