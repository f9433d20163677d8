"""log_metrics and its buffer: what the faster call and flush (issue 17) must keep.

The buffer holds one entry per call and counts points; a transaction inserts
a prefix (which may end inside a call) and drops it only after COMMIT. The
flush goes through the driver's cursor, and a driver error must still reach
the caller as ``DatabaseError`` with the driver's message, losing nothing.
Every test here runs on both ledgers.
"""

from __future__ import annotations

import gc
import math
import sqlite3
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import LedgerClient
from sqlalchemy import event

import ckptdb.manager
from ckptdb import CheckpointManager
from ckptdb.errors import ArgumentTypeError, DatabaseError, InvalidArgumentError
from ckptdb.ledger import driver
from ckptdb.ledger import rows as ledger_rows
from ckptdb.protocol.context import MetricBuffer

Opener = Callable[..., CheckpointManager]


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


def points(db: LedgerClient) -> list[tuple[Any, ...]]:
    """(step, name, value) of every metric row, in insertion (id) order."""
    return db.rows("SELECT step, name, value FROM metrics ORDER BY id")


# ------------------------------------------------------------------ the call


def test_the_buffer_keeps_its_own_copy_of_the_callers_dict(
    open_manager: Opener, db: LedgerClient
) -> None:
    """A training loop that reuses one dict must not rewrite what it logged."""
    mgr = open_manager()
    logs = {"loss": 1.0}
    mgr.log_metrics(1, logs)
    logs["loss"] = 2.0
    logs["lr"] = 0.5
    mgr.log_metrics(2, logs)
    logs.clear()
    mgr.flush()
    assert points(db) == [(1, "loss", 1.0), (2, "loss", 2.0), (2, "lr", 0.5)]


BAD_CALLS = [
    pytest.param({"ok": 1.0, "": 2.0}, ArgumentTypeError, id="empty-name"),
    pytest.param({"ok": 1.0, 3: 2.0}, ArgumentTypeError, id="int-name"),
    pytest.param({"ok": 1.0, "flag": True}, ArgumentTypeError, id="bool-value"),
    pytest.param({"ok": 1.0, "text": "0.5"}, ArgumentTypeError, id="str-value"),
    pytest.param({"ok": 1.0, "vec": torch.ones(2)}, ArgumentTypeError, id="tensor-of-two"),
    pytest.param([("ok", 1.0)], ArgumentTypeError, id="list"),
]


@pytest.mark.parametrize(("values", "error"), BAD_CALLS)
def test_a_bad_call_raises_its_typed_error_and_buffers_nothing(
    open_manager: Opener, db: LedgerClient, values: Any, error: type[Exception]
) -> None:
    mgr = open_manager()
    mgr.log_metrics(1, {"loss": 0.5})
    with pytest.raises(error):
        mgr.log_metrics(2, values)
    with pytest.raises(InvalidArgumentError):
        mgr.log_metrics(-1, {"loss": 0.25})
    assert len(mgr._ctx.metrics) == 1
    mgr.flush()
    assert points(db) == [(1, "loss", 0.5)]


def test_values_off_the_fast_path_are_converted_as_before(
    open_manager: Opener, db: LedgerClient
) -> None:
    """Ints, tensors, a read-only mapping: validated and stored as floats."""
    mgr = open_manager()
    mgr.log_metrics(1, {"lr": 3, "loss": 0.5})
    mgr.log_metrics(2, types.MappingProxyType({"norm": torch.tensor(1.25)}))
    mgr.log_metrics(3, {"loss": math.nan})
    mgr.log_metrics(4, {})
    mgr.flush()
    assert points(db) == [(1, "lr", 3.0), (1, "loss", 0.5), (2, "norm", 1.25), (3, "loss", None)]
    assert all(type(v) is float for _, _, v in points(db)[:3])


@pytest.mark.parametrize("per_call", [1, 3], ids=["one-per-call", "three-per-call"])
def test_nan_is_stored_as_null_and_infinities_as_they_are(
    open_manager: Opener, db: LedgerClient, per_call: int
) -> None:
    """The flush looks for NaN by summing the batch (inf + -inf is NaN too): whatever
    the mix, each NaN becomes NULL and nothing else changes."""
    mgr = open_manager()
    values = [math.inf, -math.inf, math.nan, 1.5, -0.0, 1e308, 1e308]
    for i, value in enumerate(values):
        mgr.log_metrics(i, {f"m{j}": value for j in range(per_call)})
    mgr.flush()
    stored = [v for _, _, v in points(db)]
    expected = [None if v != v else v for v in values for _ in range(per_call)]
    assert stored == expected
    mgr.log_metrics(9, {"m0": 1e308, "m1": 1e308})  # the sum overflows: no NaN, none made
    mgr.flush()
    assert [v for _, _, v in points(db)][-2:] == [1e308, 1e308]


def test_the_flush_threshold_counts_points_not_calls(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckptdb.manager, "METRIC_FLUSH_THRESHOLD", 5)
    mgr = open_manager()
    mgr.log_metrics(1, {"a": 1.0, "b": 2.0, "c": 3.0})
    mgr.log_metrics(2, {"a": 1.0})
    assert points(db) == [] and len(mgr._ctx.metrics) == 4
    mgr.log_metrics(3, {"a": 1.0})  # 5 points: flushed by this call
    assert len(points(db)) == 5 and len(mgr._ctx.metrics) == 0


def test_buffered_entries_are_not_tracked_by_the_garbage_collector(
    open_manager: Opener,
) -> None:
    """Tracked entries (a tuple holding a dict is) make every collection walk the
    buffer: the call then cost twice as much. Ints, floats and a dict of floats
    are never tracked."""
    mgr = open_manager()
    for step in range(100):
        mgr.log_metrics(step, {"loss": step * 0.5, "lr": 0.1})
    mgr.log_metrics(100, {"norm": torch.tensor(2.0)})
    entries = mgr._ctx.metrics.entries
    assert len(entries) == 3 * 101
    assert not [e for e in entries if gc.is_tracked(e)]


# ------------------------------------------------------------------ the buffer


@pytest.fixture
def inserted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, float, float]]:
    """What MetricBuffer.insert_into hands to the ledger, as (step, name, value, wall) points."""
    got: list[tuple[int, str, float, float]] = []

    def insert_metric_calls(
        session: Any, run_id: int, attempt_id: int, steps: Any, values: Any, walls: Any
    ) -> None:
        calls = zip(steps, values, walls, strict=True)
        got.extend((s, n, v, w) for s, vs, w in calls for n, v in vs.items())

    monkeypatch.setattr(ledger_rows, "insert_metric_calls", insert_metric_calls)
    return got


def test_a_prefix_may_end_inside_a_call(inserted: list[tuple[Any, ...]]) -> None:
    """A limit in points that cuts a call: its first points go now, the rest stay
    buffered (same step, same wall time) and go with the next insert."""
    buffer = MetricBuffer()
    buffer.add(1, {"a": 1.0, "b": 2.0, "c": 3.0})
    buffer.add(2, {"d": 4.0})
    assert buffer.insert_into(None, 1, 1, 2) == 2
    assert [p[:3] for p in inserted] == [(1, "a", 1.0), (1, "b", 2.0)]
    assert len(buffer) == 4  # nothing dropped before the commit
    buffer.drop(2)
    assert len(buffer) == 2
    assert buffer.insert_into(None, 1, 1, None) == 2
    assert [p[:3] for p in inserted[2:]] == [(1, "c", 3.0), (2, "d", 4.0)]
    assert inserted[2][3] == inserted[0][3]  # the call's wall time
    buffer.drop(2)
    assert len(buffer) == 0 and buffer.calls() == []


def test_points_logged_after_the_insert_outlive_its_drop(inserted: list[tuple[Any, ...]]) -> None:
    """A boundary commits in the background while the training loop logs on:
    its drop removes exactly the prefix it inserted."""
    buffer = MetricBuffer()
    buffer.add(1, {"a": 1.0, "b": 2.0})
    limit = len(buffer)
    buffer.add(2, {"c": 3.0})  # logged while the boundary is in flight
    assert buffer.insert_into(None, 1, 1, limit) == 2
    buffer.add(3, {"d": 4.0, "e": 5.0})
    buffer.drop(2)
    assert len(buffer) == 3
    assert [(s, dict(v)) for s, v, _ in buffer.calls()] == [
        (2, {"c": 3.0}),
        (3, {"d": 4.0, "e": 5.0}),
    ]


def test_a_limit_beyond_the_buffer_takes_all_of_it(inserted: list[tuple[Any, ...]]) -> None:
    buffer = MetricBuffer()
    buffer.add(1, {"a": 1.0})
    assert buffer.insert_into(None, 1, 1, 5) == 1
    buffer.drop(5)
    assert len(buffer) == 0 and buffer.calls() == []


# ------------------------------------------------------------------- the flush


def test_a_driver_error_in_the_flush_is_a_database_error_and_loses_nothing(
    open_manager: Opener, db: LedgerClient
) -> None:
    """An attempt id the ledger lacks breaks a foreign key inside the executemany."""
    mgr = open_manager()
    mgr.log_metrics(1, {"loss": 0.5, "lr": 0.1})
    attempt = mgr._ctx.attempt_id
    mgr._ctx.attempt_id = attempt + 1000
    with pytest.raises(DatabaseError, match=r"(?i)foreign key") as info:
        mgr.flush()
    assert info.value.original is not None
    assert len(mgr._ctx.metrics) == 2
    assert points(db) == []

    mgr._ctx.attempt_id = attempt
    mgr.flush()
    assert points(db) == [(1, "loss", 0.5), (1, "lr", 0.1)]


class _Cursor:
    """A driver cursor whose executemany fails, and whose close may fail too."""

    def __init__(self, error: Exception, close_error: Exception | None) -> None:
        self.error, self.close_error, self.closed = error, close_error, False

    def executemany(self, statement: str, rows: Any) -> None:
        raise self.error

    def close(self) -> None:
        self.closed = True
        if self.close_error is not None:
            raise self.close_error


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("close_fails", [False, True], ids=["closes", "close-fails"])
def test_the_cursor_is_closed_after_a_failure_and_a_failed_close_is_noted(
    open_manager: Opener, close_fails: bool
) -> None:
    mgr = open_manager()
    close_error = sqlite3.OperationalError("disk I/O error") if close_fails else None
    cursor = _Cursor(sqlite3.OperationalError("database is locked"), close_error)
    with (
        pytest.raises(DatabaseError, match="database is locked") as info,
        mgr._ctx.ledger.transaction() as session,
    ):
        real = session.connection()
        fake = types.SimpleNamespace(
            cursor=lambda: cursor, dbapi_connection=real.connection.dbapi_connection
        )
        proxy = types.SimpleNamespace(dialect=real.dialect, dispatch=real.dispatch, connection=fake)
        driver.executemany(proxy, "INSERT ...", [(1,)])  # type: ignore[arg-type]
    assert cursor.closed
    notes = getattr(info.value.__cause__, "__notes__", [])
    assert ("disk I/O error" in " ".join(notes)) is close_fails


def test_engine_listeners_see_the_flush_as_with_sqlalchemy(open_manager: Opener) -> None:
    """Tracing (and the statement counts of tests and benchmarks) hooks the engine's
    cursor events: the driver-level insert fires them, with its rows as a list."""
    mgr = open_manager()
    seen: list[tuple[str, str, int, bool]] = []

    def before(_c: Any, _cur: Any, statement: str, rows: Any, _ctx: Any, many: bool) -> None:
        seen.append(("before", statement.split()[0], len(rows), many))

    def after(_c: Any, _cur: Any, statement: str, rows: Any, _ctx: Any, many: bool) -> None:
        seen.append(("after", statement.split()[0], len(rows), many))

    engine = mgr._ctx.ledger.engine
    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)
    try:
        mgr.log_metrics(1, {"a": 1.0, "b": 2.0})
        mgr.log_metrics(2, {"a": 1.5})
        mgr.flush()
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)
    inserts = [s for s in seen if s[1] == "INSERT"]
    assert inserts == [("before", "INSERT", 3, True), ("after", "INSERT", 3, True)]
