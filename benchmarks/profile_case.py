"""Case ``profile``: where a steady boundary's time goes, on SQLite and on PostgreSQL.

The ``floor`` case says how far the 3-stream boundary is from its physical
minimum; this one says why. Both contenders of that case (ckptdb's boundary
and the minimum: three durable publishes and one durable ledger commit) run
interleaved with a :class:`Meter` installed, which times every call that is
I/O rather than Python: ``os.fsync``, ``os.unlink``, ``os.replace`` and
``os.rename`` (every one ckptdb makes goes through them), and each SQL
statement and commit of the ledger (SQLAlchemy's cursor events and the
dialect's commit). What is left of a boundary's wall time is the
serialisation of the payloads (the same ``torch.save`` in both contenders) and
Python; the difference between the two contenders' rests is the boundary's
own Python (admission, retention, records, the fence).

SQLite's own fsync of its WAL happens inside the commit and is counted as
SQL. On PostgreSQL the server flushes its WAL at each synchronous commit; the
client only waits for it, so that wait is SQL here too. The PostgreSQL
profile runs when ``CKPTDB_BENCH_POSTGRES_URL`` names a server (a schema of
its own is created and dropped); the minimum there commits one row through
the same driver.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.pool import NullPool

from ckptdb import CheckpointManager
from ckptdb.errors import note_on

from .cases import FLOOR_STREAMS, SyncedSqliteCommit, durable_publish
from .harness import Comparison, compare

#: The environment variable naming the PostgreSQL server of the profile (optional).
POSTGRES_VARIABLE = "CKPTDB_BENCH_POSTGRES_URL"
#: What the meter times, besides the rest (serialisation and Python).
CATEGORIES = ("sql", "fsync", "unlink", "rename")
_OS_CALLS = {"fsync": "fsync", "unlink": "unlink", "replace": "rename", "rename": "rename"}
#: Boundaries per contender for each of the harness's repetitions.
BOUNDARIES_PER_REP = 30


class Meter:
    """Seconds and calls per category, while installed: the I/O a boundary waits on."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def timed(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] += time.perf_counter() - start
                self.calls[category] += 1

        return wrapper

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        originals = {name: getattr(os, name) for name in _OS_CALLS}
        for name, category in _OS_CALLS.items():
            setattr(os, name, self.timed(category, originals[name]))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(os, name, fn)

    def watch(self, engine: Engine) -> None:
        """Time the ledger's statements (cursor events) and commits (the dialect's)."""
        started: list[float] = []

        def before(*_: Any) -> None:
            started.append(time.perf_counter())

        def after(*_: Any) -> None:
            self.seconds["sql"] += time.perf_counter() - started.pop()
            self.calls["sql"] += 1

        event.listen(engine, "before_cursor_execute", before)
        event.listen(engine, "after_cursor_execute", after)
        dialect: Any = engine.dialect
        dialect.do_commit = self.timed("sql", dialect.do_commit)

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        return Counter(self.seconds), Counter(self.calls)


class Profiled:
    """A contender whose every call is split by a :class:`Meter` into its categories."""

    def __init__(self, meter: Meter, body: Callable[[], None]) -> None:
        self.meter, self.body = meter, body
        self.walls: list[float] = []
        self.parts: dict[str, list[float]] = {c: [] for c in CATEGORIES}
        self.counts: dict[str, list[int]] = {c: [] for c in CATEGORIES}

    def __call__(self) -> float:
        seconds, calls = self.meter.snapshot()
        start = time.perf_counter()
        for _ in range(BOUNDARIES_PER_REP):
            self.body()
        wall = (time.perf_counter() - start) / BOUNDARIES_PER_REP
        self.walls.append(wall)
        for category in CATEGORIES:
            spent = self.meter.seconds[category] - seconds[category]
            self.parts[category].append(spent / BOUNDARIES_PER_REP)
            made = self.meter.calls[category] - calls[category]
            self.counts[category].append(round(made / BOUNDARIES_PER_REP))
        return wall

    def breakdown(self) -> dict[str, Any]:
        """Median milliseconds per boundary of each category and of the rest, and calls."""
        ms = {c: round(statistics.median(v) * 1e3, 3) for c, v in self.parts.items()}
        wall = statistics.median(self.walls) * 1e3
        ms["rest (serialisation, Python)"] = round(wall - sum(ms.values()), 3)
        ms["wall"] = round(wall, 3)
        calls = {c: max(v) for c, v in self.counts.items()}
        return {"ms": ms, "calls": calls}


def profile(work: Path, reps: int) -> list[Comparison]:
    """The SQLite profile, and the PostgreSQL one where :data:`POSTGRES_VARIABLE` is set."""
    found = [_profile(work / "sqlite", reps, None)]
    url = os.environ.get(POSTGRES_VARIABLE)
    if url:
        with _schema(url) as schema_url:
            found.append(_profile(work / "postgresql", reps, schema_url))
    return found


def _profile(work: Path, reps: int, db_url: str | None) -> Comparison:
    ledger = "PostgreSQL" if db_url else "SQLite"
    meter = Meter()
    mgr = CheckpointManager(work / "run", streams=dict(FLOOR_STREAMS), db_url=db_url)
    meter.watch(mgr._ctx.ledger.engine)
    tiny = {"w": torch.ones(4)}
    steps, files = itertools.count(), itertools.count()
    floor_dir = work / "floor"
    for stream in FLOOR_STREAMS:
        (floor_dir / stream).mkdir(parents=True)
    commit = _minimum_commit(work, db_url)

    def minimum() -> None:
        name = f"{next(files)}.pt"
        for stream in FLOOR_STREAMS:
            durable_publish(tiny, floor_dir / stream / name)
        meter.timed("sql", commit)()

    def boundary() -> None:
        step = next(steps)
        mgr.save(step, metrics={"loss": float(-step)}, model=tiny, best=tiny, ema=tiny)

    for _ in range(5):  # fill the streams: from here on every stream evicts
        boundary()
    contenders = {
        "physical minimum": Profiled(meter, minimum),
        "ckptdb save": Profiled(meter, boundary),
    }
    try:
        with meter.installed():
            result = compare(
                f"where a 3-stream boundary's time goes ({ledger})",
                dict(contenders),
                baseline="physical minimum",
                reps=reps,
            )
    finally:
        commit.close()
        mgr.close()
        shutil.rmtree(work)
    for name, contender in contenders.items():
        result.notes[name] = contender.breakdown()
    return result


class _PostgresCommit:
    """One row committed through the ledger's own driver: the floor of a durable commit."""

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url, poolclass=NullPool)
        self.conn = self.engine.connect()
        self.conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS t (id SERIAL PRIMARY KEY, step INT)")
        self.conn.commit()
        self.counter = itertools.count()

    def __call__(self) -> None:
        self.conn.exec_driver_sql("INSERT INTO t (step) VALUES (%(s)s)", {"s": next(self.counter)})
        self.conn.commit()

    def close(self) -> None:
        self.conn.close()
        self.engine.dispose()


def _minimum_commit(work: Path, db_url: str | None) -> Any:
    return _PostgresCommit(db_url) if db_url else SyncedSqliteCommit(work / "floor.sqlite")


@contextlib.contextmanager
def _schema(url: str) -> Iterator[str]:
    """A schema of its own on the server at ``url`` (dropped after), as a ledger URL."""
    name = f"bench_{secrets.token_hex(6)}"
    admin = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE SCHEMA {name}")
        options = {"options": f"-csearch_path={name}"}
        yield make_url(url).update_query_dict(options).render_as_string(hide_password=False)
    except BaseException as primary:
        try:
            _drop_schema(admin, name)
        except Exception as dropping:  # the profile's own error stays the one raised
            note_on(primary, f"dropping the profile's schema {name} failed too: {dropping!r}")
        raise
    else:
        _drop_schema(admin, name)
    finally:
        admin.dispose()


def _drop_schema(admin: Engine, name: str) -> None:
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {name} CASCADE")
