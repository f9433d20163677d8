"""PostgreSQL ledgers, and the core protocol on both backends.

Tests taking ``backend`` run twice: on the run's own SQLite file and on a
PostgreSQL schema of their own (``CKPTDB_TEST_POSTGRES_URL``; see conftest).
Tests taking ``pg_url`` need the server only. The ledger is inspected with
plain SQL through :func:`helpers.ledger_rows`, as any client would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from helpers import (
    files,
    invoke,
    ledger_objects,
    ledger_rows,
    migrate_to,
    pg_admin,
    run_script,
    schema_diff,
    state,
    value_of,
)
from sqlalchemy import create_engine, inspect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from ckptdb import CheckpointManager, Keep, TopK
from ckptdb.errors import (
    CkptDBError,
    InvalidArgumentError,
    LedgerError,
    LedgerLockedError,
    PublishError,
    SchemaVersionError,
)
from ckptdb.ledger.engine import (
    MIGRATION_LOCK_KEY,
    default_sqlite_url,
    migrate,
    newest_revision,
    open_ledger,
)
from ckptdb.ledger.lock import AdvisoryWriterLock, FileWriterLock, writer_lock
from ckptdb.ledger.models import VIEW_NAMES
from ckptdb.reader import RunReader

Opener = Callable[..., CheckpointManager]
TESTS = Path(__file__).resolve().parent
STREAMS = {"model": Keep(last=3), "ema": Keep(last=2), "best": TopK(2, "val_loss")}
TABLES_0001 = {"runs", "attempts", "streams", "checkpoints", "pointers", "metrics", "events"}
TABLES = TABLES_0001 | {"pins", "evaluations"}


@pytest.fixture
def ledger(backend: str | None, root: Path) -> Iterator[Opener]:
    """Open managers with the backend's ``db_url``; all are closed before the schema goes."""
    opened: list[CheckpointManager] = []

    def factory(path: Path | None = None, **kwargs: Any) -> CheckpointManager:
        mgr = CheckpointManager(path or root, db_url=backend, **kwargs)
        opened.append(mgr)
        return mgr

    yield factory
    for mgr in opened:
        mgr.close()


def url_of(root: Path, backend: str | None) -> str:
    return backend or default_sqlite_url(root)


def sql(root: Path, backend: str | None, statement: str, **params: Any) -> list[tuple[Any, ...]]:
    return ledger_rows(url_of(root, backend), statement, **params)


def committed(root: Path, backend: str | None) -> list[tuple[Any, ...]]:
    return sql(
        root,
        backend,
        "SELECT stream, step, path FROM checkpoints WHERE state = 'committed' ORDER BY id",
    )


def pointers(root: Path, backend: str | None) -> dict[str, int]:
    return dict(sql(root, backend, "SELECT name, checkpoint_id FROM pointers"))


def boundary(value: float) -> dict[str, Any]:
    return {"model": state(value), "ema": state(value + 0.5), "best": state(value)}


def start_script(tmp_path: Path, code: str, *args: str, name: str = "child.py") -> Any:
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )


# ------------------------------------------------------- the core protocol, both backends


def test_save_latest_best_load(ledger: Opener, root: Path, backend: str | None) -> None:
    mgr = ledger(streams=STREAMS)
    losses = {10: 0.9, 20: 0.3, 30: 0.5, 40: 0.8}
    for step, loss in losses.items():
        result = mgr.save(step, metrics={"val_loss": loss}, **boundary(step))
        assert {c.state for c in result.values()} == {"committed"}
    assert mgr.latest("model").step == 40
    assert mgr.latest("ema").step == 40
    assert [c.step for c in mgr.best("best")] == [20, 30]
    assert [c.step for c in mgr.checkpoints("model")] == [20, 30, 40]
    assert float(mgr.load("latest")["b"][0]) == 40.0
    assert float(mgr.load("best")["b"][0]) == 20.0
    assert float(mgr.load(30)["b"][0]) == 30.0
    assert mgr.check() == []
    # files on disk are exactly the committed rows
    assert files(mgr.save_dir) == sorted(p for _s, _t, p in committed(root, backend))
    assert pointers(root, backend) == {
        f"latest:{s}": mgr.latest(s).id for s in ("model", "ema", "best")
    }


def test_a_failed_write_leaves_every_stream_as_before(
    ledger: Opener, root: Path, backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = ledger(streams=STREAMS)
    mgr.save(10, metrics={"val_loss": 1.0}, **boundary(1))
    before = committed(root, backend), pointers(root, backend), files(mgr.save_dir)
    payloads = boundary(2)
    real_save = torch.save

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if obj is payloads["ema"]:
            raise RuntimeError("serializer exploded")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(PublishError) as info:
        mgr.save(20, metrics={"val_loss": 0.5}, **payloads)
    assert info.value.phase == "write"
    assert (committed(root, backend), pointers(root, backend), files(mgr.save_dir)) == before
    states = sql(root, backend, "SELECT stream, state, error FROM checkpoints WHERE step = 20")
    assert sorted(s for s, _, _ in states) == ["best", "ema", "model"]
    assert all(st == "aborted" and "serializer exploded" in err for _, st, err in states)
    monkeypatch.undo()
    assert set(mgr.save(20, metrics={"val_loss": 0.5}, **payloads)) == {"model", "ema", "best"}


def test_timeline_rule_evicts_the_abandoned_steps(
    ledger: Opener, root: Path, backend: str | None
) -> None:
    mgr = ledger(streams={"model": Keep(last=5), "best": TopK(3, "val_loss")})
    for step in (10, 20, 30, 40):
        mgr.save(step, metrics={"val_loss": step / 100}, model=state(step), best=state(step))
    mgr.save(20, metrics={"val_loss": 0.05}, model=state(-20), best=state(-20))
    assert [c.step for c in mgr.checkpoints("model")] == [10, 20]
    assert float(mgr.load("latest")["b"][0]) == -20.0
    # top-K members stay by metric; the re-saved step replaced its entry
    assert [(c.step, c.metric) for c in mgr.best("best")] == [(20, 0.05), (10, 0.1), (30, 0.3)]
    gone = sql(
        root, backend, "SELECT step FROM checkpoints WHERE stream = 'model' AND state = 'deleted'"
    )
    assert sorted(s for (s,) in gone) == [20, 30, 40]
    assert mgr.check() == []


def test_topk_admission_and_ranking(ledger: Opener, root: Path, backend: str | None) -> None:
    mgr = ledger(streams={"best": TopK(2, "acc", mode="max")})
    for step, acc in [(1, 0.5), (2, 0.7), (3, 0.6)]:
        assert set(mgr.save(step, metrics={"acc": acc}, best=state(step))) == {"best"}
    assert mgr.save(4, metrics={"acc": 0.1}, best=state(4)) == {}  # not admitted, not written
    assert [c.step for c in mgr.best("best")] == [2, 3]
    assert sql(root, backend, "SELECT COUNT(*) FROM checkpoints WHERE step = 4") == [(0,)]
    ranked = RunReader(root, db_url=backend)
    try:
        _, found = ranked.sql("SELECT step, rank FROM best_checkpoints ORDER BY rank")
    finally:
        ranked.close()
    assert found == [(2, 1), (3, 2)]


def test_metrics_round_trip_with_nan(ledger: Opener, root: Path, backend: str | None) -> None:
    mgr = ledger()
    mgr.log_metrics(1, {"loss": 2.5, "lr": 1e-3})
    mgr.log_metrics(2, {"loss": float("nan")})
    mgr.save(2, model=state(2))
    with RunReader(root, db_url=backend) as reader:
        history = reader.metric_history("loss")
        assert reader.metric_names() == ["loss", "lr"]
    assert history[0] == (1, 2.5, mgr.attempt_id)
    assert history[1][0] == 2 and history[1][1] != history[1][1]  # NaN back from NULL


CRASHING_CHILD = """
    import os, sys
    import torch
    from ckptdb import CheckpointManager, faults
    mgr = CheckpointManager(sys.argv[1], db_url=sys.argv[2] or None)
    mgr.save(1, model={"w": torch.full((4,), 1.0)})
    faults.set_hook(lambda point: os._exit(17) if point == "after_fsync" else None)
    mgr.save(2, model={"w": torch.full((4,), 2.0)})
"""


def test_reconcile_at_open_after_a_crash(
    ledger: Opener, root: Path, backend: str | None, tmp_path: Path
) -> None:
    """Killed between write and commit: a pending row and a temp file, repaired at open."""
    result = run_script(tmp_path, CRASHING_CHILD, str(root), backend or "")
    assert result.returncode == 17, result.stderr
    assert sql(root, backend, "SELECT step, state FROM checkpoints ORDER BY id") == [
        (1, "committed"),
        (2, "pending"),
    ]
    save_dir = root / "checkpoints"
    assert [p for p in files(save_dir) if ".tmp-" in p], "the crash left no temp file"

    mgr = ledger()
    assert mgr.last_reconcile.counts.get("rolled_back") == 1
    assert sql(root, backend, "SELECT step, state FROM checkpoints ORDER BY id") == [
        (1, "committed"),
        (2, "aborted"),
    ]
    assert files(save_dir) == ["model/step-000000001.pt"]
    assert mgr.latest().step == 1
    assert float(mgr.load("latest")["w"][0]) == 1.0
    assert [s for (s,) in sql(root, backend, "SELECT end_state FROM attempts ORDER BY id")] == [
        "crashed",
        "running",
    ]
    assert mgr.check() == []
    assert mgr.reconcile().actions == []  # idempotent


def test_readers_refuse_writes(ledger: Opener, root: Path, backend: str | None) -> None:
    mgr = ledger()
    mgr.save(1, model=state(1))
    before = committed(root, backend)
    with RunReader(root, db_url=backend) as reader:
        for statement in (
            "DELETE FROM checkpoints",
            "UPDATE pointers SET checkpoint_id = 0",
            "CREATE TABLE intruder (i INTEGER)",
        ):
            with pytest.raises(InvalidArgumentError, match="SQL error"):
                reader.sql(statement)
        # a literal '%' is not a placeholder, on either driver
        _, found = reader.sql("SELECT name FROM pointers WHERE name LIKE 'latest:%'")
        assert found == [("latest:model",)]
    assert committed(root, backend) == before
    mgr.save(2, model=state(2))  # the writer was not disturbed


def test_views_answer_on_both_backends(ledger: Opener, root: Path, backend: str | None) -> None:
    mgr = ledger(streams=STREAMS)
    for step in (1, 2, 3):
        mgr.log_metrics(step, {"loss": 1.0 / step})
        mgr.save(step, metrics={"val_loss": 1.0 / step}, **boundary(step))
    with RunReader(root, db_url=backend) as reader:
        reader.record_evaluation(reader.latest(), {"eval/acc": 0.9}, evaluator="sidecar")
        for view in VIEW_NAMES:
            headers, found = reader.sql(f"SELECT * FROM {view}")
            assert headers and found, view
        _, scored = reader.sql(
            "SELECT stream, step, evaluator, name, value FROM checkpoint_evaluations"
        )
        _, latest = reader.sql("SELECT stream, step FROM latest_checkpoints ORDER BY stream")
        _, restarts = reader.sql("SELECT attempts, restarts, crashes FROM run_restarts")
        _, summary = reader.sql("SELECT last_step_seen, end_state FROM attempt_summary")
    assert latest == [("best", 3), ("ema", 3), ("model", 3)]
    assert [tuple(int(v) for v in r) for r in restarts] == [(1, 0, 0)]
    assert summary == [(3, "running")]
    assert scored == [("model", 3, "sidecar", "eval/acc", 0.9)]


# ---------------------------------------------------------------- schema and migrations


def test_migrated_schema_matches_the_models(
    ledger: Opener, root: Path, backend: str | None
) -> None:
    ledger().close()
    diff = schema_diff(url_of(root, backend))
    assert diff == [], "a model change lacks a migration:\n" + "\n".join(map(str, diff))


def step_types(url: str) -> set[str]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            return {
                str(c["type"])
                for table in ("checkpoints", "metrics", "events")
                for c in insp.get_columns(table)
                if c["name"] == "step"
            }
    finally:
        engine.dispose()


def test_downgrade_of_0003_then_upgrade(ledger: Opener, root: Path, backend: str | None) -> None:
    """0003 only widens the step columns on PostgreSQL: undone (with 0004, which only
    adds ``aliases``), every table and view of 0002 is still there (the views were
    dropped and created again around the change)."""
    ledger().close()
    url = url_of(root, backend)
    wide = {"BIGINT"} if backend is not None else {"INTEGER"}  # SQLite's is 64-bit
    assert step_types(url) == wide
    migrate_to(url, "0002", down=True)
    tables, views, version = ledger_objects(url)
    assert version == "0002" and tables >= TABLES and "aliases" not in tables
    assert views == set(VIEW_NAMES)
    assert step_types(url) == {"INTEGER"}
    migrate_to(url, "head")
    assert ledger_objects(url)[1] == set(VIEW_NAMES)
    assert step_types(url) == wide
    assert schema_diff(url) == []
    mgr = ledger()
    mgr.save(1, model=state(1))
    assert mgr.latest().step == 1


def test_a_downgrade_that_would_truncate_a_step_changes_nothing(pg_url: str, root: Path) -> None:
    """Back to 32-bit steps is refused by PostgreSQL while a step needs 64 bits: the
    revision, the columns and the views stay as they were (one transaction)."""
    with CheckpointManager(root, db_url=pg_url, streams={"model": Keep(last=None)}) as mgr:
        mgr.save(2**40, metrics={"loss": 0.5}, model=state(1))
    url = url_of(root, pg_url)
    with pytest.raises(DBAPIError, match="out of range"):
        migrate_to(url, "0002", down=True)  # 0004's drop of aliases is undone with it
    tables, views, version = ledger_objects(url)
    assert version == newest_revision() and "aliases" in tables and views == set(VIEW_NAMES)
    assert step_types(url) == {"BIGINT"}
    with RunReader(root, db_url=pg_url) as reader:
        assert reader.latest().step == 2**40
        assert reader.sql("SELECT step FROM latest_checkpoints")[1] == [(2**40,)]


def at_0002_with_views(url: str, *views: str) -> None:
    migrate_to(url, "0002")
    with pg_admin(url) as conn:
        for view in views:
            conn.exec_driver_sql(view)


def revision_and_views(url: str) -> tuple[str, set[str]]:
    _, views, version = ledger_objects(url)
    return version, views


def test_a_users_view_on_the_steps_stops_the_upgrade_by_name_and_changes_nothing(
    pg_url: str, root: Path
) -> None:
    """0003 must drop ckptdb's views to widen the steps; a view of the user's own
    that reads them, or reads a step column, is never dropped: the open fails
    naming both, and the ledger stays at 0002 with every view in place."""
    at_0002_with_views(
        pg_url,
        "CREATE VIEW my_best AS SELECT step FROM best_checkpoints",
        "CREATE VIEW my_steps AS SELECT name, step FROM metrics",
    )
    with pytest.raises(
        SchemaVersionError, match=r"not ckptdb's: t_\w+\.my_best, t_\w+\.my_steps\."
    ):
        CheckpointManager(root, db_url=pg_url, streams={"model": Keep(last=None)})
    assert revision_and_views(pg_url) == ("0002", set(VIEW_NAMES) | {"my_best", "my_steps"})
    assert step_types(pg_url) == {"INTEGER"}


def test_a_users_view_that_reads_no_step_survives_the_upgrade(pg_url: str, root: Path) -> None:
    at_0002_with_views(pg_url, "CREATE VIEW my_paths AS SELECT path, state FROM checkpoints")
    with CheckpointManager(root, db_url=pg_url, streams={"model": Keep(last=None)}) as mgr:
        mgr.save(2**33, model=state(1))
    assert revision_and_views(pg_url) == (newest_revision(), set(VIEW_NAMES) | {"my_paths"})
    assert step_types(pg_url) == {"BIGINT"}
    assert len(sql(root, pg_url, "SELECT path FROM my_paths")) == 1


# --------------------------------------------------------------- readers during a save loop

SAVES = 40


def test_readers_never_see_uncommitted_rows_nor_stall_the_writer(
    ledger: Opener, root: Path, backend: str | None, tmp_path: Path
) -> None:
    mgr = ledger(streams={"model": Keep(last=None), "ema": Keep(last=2)})
    mgr.save(0, model=state(0), ema=state(0))
    stop, out = tmp_path / "stop", tmp_path / "hammer.json"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import helpers; helpers.hammer(*sys.argv[2:])"
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", code, str(TESTS), str(root), backend or "", str(stop), str(out)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{out}.ready").exists():
            assert reader.poll() is None, reader.communicate()[1]
            assert time.monotonic() < deadline, "the reader never started"
            time.sleep(0.05)
        time.sleep(0.5)  # let it get going
        durations = []
        for step in range(1, SAVES + 1):
            started = time.monotonic()
            mgr.save(step, model=state(step, n=256), ema=state(step))
            durations.append(time.monotonic() - started)
    finally:
        stop.touch()
        try:
            _, err = reader.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            reader.kill()
            raise
    assert reader.returncode == 0, err
    report = json.loads(out.read_text())
    assert report["violations"] == []
    assert report["rounds"] > 0 and len(set(report["seen"])) > 1, report  # it saw progress
    steps = {s for (s,) in sql(root, backend, "SELECT step FROM checkpoints")}
    assert set(report["seen"]) <= steps
    assert max(durations) < 5, f"a save stalled for {max(durations):.1f}s"
    assert [c.step for c in mgr.checkpoints("model")] == list(range(SAVES + 1))
    assert mgr.check() == []


# ------------------------------------------------------------------------ the CLI


def cli(*args: Any) -> Result:
    return invoke(CliRunner(), *args)


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_every_cli_command_takes_the_db_url(
    ledger: Opener, root: Path, backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTDB_DB_URL", raising=False)
    with ledger(streams=STREAMS) as mgr:
        for step, loss in [(1, 0.5), (2, 0.2), (3, 0.4)]:
            mgr.log_metrics(step, {"loss": loss})
            mgr.save(step, metrics={"val_loss": loss}, **boundary(step))
        (mgr.save_dir / "model" / "step-000000099.pt").write_bytes(b"orphan")
        save_dir = mgr.save_dir
    url = ["--db-url", backend] if backend else []
    status = json.loads(ok(cli("status", root, *url, "--json")))
    assert {s["name"]: s["latest_step"] for s in status["streams"]} == {
        "best": 3,
        "ema": 3,
        "model": 3,
    }
    assert len(json.loads(ok(cli("list", root, "--stream", "model", *url, "--json")))) == 3
    assert ok(cli("latest", root, *url)).strip() == str(save_dir / "model/step-000000003.pt")
    assert ok(cli("best", root, *url)).split() == [
        str(save_dir / "best/step-000000002.pt"),
        str(save_dir / "best/step-000000003.pt"),
    ]
    history = json.loads(ok(cli("history", root, "--metric", "loss", *url, "--json")))
    assert [p["step"] for p in history] == [1, 2, 3]
    query = (
        "SELECT stream, COUNT(*) AS n FROM checkpoints WHERE state = 'committed' "
        "GROUP BY stream ORDER BY stream"
    )
    assert ok(cli("sql", root, query, "--format", "csv", *url)).split() == [
        "stream,n",
        "best,2",
        "ema,2",
        "model,3",
    ]
    refused = cli("sql", root, "DELETE FROM checkpoints", *url)
    assert refused.exit_code == 1 and "SQL error" in refused.output
    report = json.loads(ok(cli("reconcile", root, "--dry-run", *url, "--json")))
    assert report["counts"] == {"quarantined": 1}
    ok(cli("reconcile", root, *url))
    assert "consistent" in ok(cli("check", root, *url))
    assert "0 checkpoint(s) evicted" in ok(cli("gc", root, *url))
    assert f"ledger {newest_revision()}" in ok(cli("db", "current", root, *url))
    assert f"schema {newest_revision()}" in ok(cli("db", "upgrade", root, *url))
    if backend:  # the environment variable works as well
        monkeypatch.setenv("CKPTDB_DB_URL", backend)
        assert ok(cli("latest", root)).strip().endswith("model/step-000000003.pt")


def test_maintenance_commands_refuse_a_run_the_ledger_does_not_have(
    ledger: Opener, root: Path, backend: str | None, tmp_path: Path
) -> None:
    ledger().close()
    url = backend or f"sqlite:///{root / 'ckptdb.sqlite'}"
    elsewhere = tmp_path / "typo"
    for command_ in ("gc", "check", "reconcile"):
        result = cli(command_, elsewhere, "--db-url", url)
        assert result.exit_code == 1, result.output
        assert "no ckptdb run at" in result.output
    assert not elsewhere.exists()  # and nothing was created for it
    assert sql(root, backend, "SELECT COUNT(*) FROM runs") == [(1,)]


# ------------------------------------------------------------ PostgreSQL: the writer lock


def test_second_writer_of_a_run_is_refused_at_once_naming_the_holder(
    pg_url: str, root: Path
) -> None:
    with CheckpointManager(root, db_url=pg_url) as first:
        started = time.monotonic()
        with pytest.raises(LedgerLockedError) as info:
            CheckpointManager(root, db_url=pg_url)
        assert time.monotonic() - started < 5
        err = info.value
        assert isinstance(err, CkptDBError) and isinstance(err, RuntimeError)
        assert f"pid {os.getpid()} on host " in str(err)
        assert err.holder["pid"] == os.getpid()
        assert socket.gethostname().startswith(str(err.holder["host"]))
        assert isinstance(err.holder["backend_pid"], int)
        first.save(1, model=state(1))  # the refusal disturbed nothing
        assert ledger_rows(pg_url, "SELECT COUNT(*) FROM attempts") == [(1,)]
    assert not (root / "ckptdb.lock").exists()  # no file lock, no SQLite file
    assert not (root / "ckptdb.sqlite").exists()


def test_writers_of_different_runs_do_not_block_each_other(pg_url: str, tmp_path: Path) -> None:
    managers = [CheckpointManager(tmp_path / f"run{i}", db_url=pg_url) for i in range(3)]
    try:
        for i, mgr in enumerate(managers):
            mgr.save(i, model=state(i))
        assert len({mgr.run_id for mgr in managers}) == 3
    finally:
        for mgr in managers:
            mgr.close()


def test_the_lock_is_released_on_close(pg_url: str, root: Path) -> None:
    CheckpointManager(root, db_url=pg_url).close()
    with CheckpointManager(root, db_url=pg_url):
        pass
    with CheckpointManager(root, db_url=pg_url) as mgr:
        mgr.save(1, model=state(1))
    assert ledger_rows(pg_url, "SELECT end_state FROM attempts ORDER BY id") == [
        ("closed",),
        ("closed",),
        ("closed",),
    ]


def test_the_lock_is_released_when_open_fails(pg_url: str, root: Path) -> None:
    CheckpointManager(root, db_url=pg_url).close()
    with pg_admin(pg_url) as conn:  # a ledger from a newer ckptdb: refused after locking
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = 'zzzz'")
    with pytest.raises(SchemaVersionError):
        CheckpointManager(root, db_url=pg_url)
    with pg_admin(pg_url) as conn:
        conn.exec_driver_sql(f"UPDATE alembic_version SET version_num = '{newest_revision()}'")
    CheckpointManager(root, db_url=pg_url).close()


HOLDER_CHILD = """
    import sys, time
    import torch
    from ckptdb import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], db_url=sys.argv[2])
    mgr.save(7, model={"w": torch.full((4,), 7.0)})
    print("ready", flush=True)
    time.sleep(600)
"""


def test_the_lock_is_released_when_the_holder_is_killed(
    pg_url: str, root: Path, tmp_path: Path
) -> None:
    child = start_script(tmp_path, HOLDER_CHILD, str(root), pg_url)
    try:
        line = child.stdout.readline()
        assert line.strip() == "ready", child.stderr.read() if child.poll() is not None else line
        with pytest.raises(LedgerLockedError) as info:
            CheckpointManager(root, db_url=pg_url)
        assert info.value.holder["pid"] == child.pid
        assert f"pid {child.pid}" in str(info.value)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    deadline = time.monotonic() + 30
    while True:  # the server notices the closed connection at once, or nearly
        try:
            mgr = CheckpointManager(root, db_url=pg_url)
            break
        except LedgerLockedError:
            assert time.monotonic() < deadline, "the killed holder's lock was never released"
            time.sleep(0.1)
    with mgr:
        assert mgr.latest().step == 7
        assert ledger_rows(pg_url, "SELECT pid, end_state FROM attempts ORDER BY id") == [
            (child.pid, "crashed"),
            (os.getpid(), "running"),
        ]


def test_a_lost_lock_session_is_taken_back_when_no_other_writer_took_the_run(
    pg_url: str, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The lock's connection is killed (a failover, an idle-session reaper): the next
    boundary takes the lock again on a new session and commits, since no other
    writer opened the run in between (tests/test_ledger_outage.py: when one did)."""
    with CheckpointManager(root, db_url=pg_url) as mgr:
        mgr.save(1, model=state(1))
        lock = mgr._ctx.lock
        assert isinstance(lock, AdvisoryWriterLock)
        with pg_admin(pg_url) as conn:
            conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                f"WHERE application_name = 'ckptdb pid={os.getpid()} host={socket.gethostname()}'"
            )
        mgr.save(2, model=state(2))
        assert mgr.latest().step == 2 and lock.lost is None
        # held again: a second writer is refused, as before the session ended
        with pytest.raises(LedgerLockedError):
            CheckpointManager(root, db_url=pg_url)
    assert "taking the lock again" in caplog.text
    assert ledger_rows(pg_url, "SELECT step, state FROM checkpoints ORDER BY id") == [
        (1, "committed"),
        (2, "committed"),
    ]


def test_lock_kind_follows_the_url(tmp_path: Path) -> None:
    assert isinstance(writer_lock(tmp_path, "sqlite:///x.sqlite"), FileWriterLock)
    pg = writer_lock(tmp_path, "postgresql://u@h/db")
    assert isinstance(pg, AdvisoryWriterLock)
    assert pg.url.startswith("postgresql+psycopg://")
    other = writer_lock(tmp_path / "b", "postgresql+psycopg://u@h/db")
    assert isinstance(other, AdvisoryWriterLock)
    assert pg.key != other.key  # a stable key per run root
    assert pg.key == AdvisoryWriterLock(tmp_path, "postgresql+psycopg://x@y/z").key
    assert -(2**63) <= pg.key < 2**63


def test_first_opens_of_an_empty_database_do_not_race(pg_url: str, tmp_path: Path) -> None:
    """Migrations hold a database-wide advisory lock: concurrent first opens all succeed."""
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []
    managers: list[CheckpointManager] = []

    def open_run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            managers.append(CheckpointManager(tmp_path / f"run{i}", db_url=pg_url))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for mgr in managers:
        mgr.close()
    assert errors == []
    assert len(managers) == 4
    versions = ledger_rows(pg_url, "SELECT version_num FROM alembic_version")
    assert versions == [(newest_revision(),)]


def test_migrate_waits_for_a_migration_in_progress(pg_url: str) -> None:
    ledger_ = open_ledger(pg_url)
    try:
        with pg_admin(pg_url) as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})")
            done = threading.Event()
            worker = threading.Thread(target=lambda: (migrate(ledger_.engine), done.set()))
            worker.start()
            assert not done.wait(0.5), "migrate did not wait for the migration lock"
            conn.exec_driver_sql(f"SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})")
            assert done.wait(30)
            worker.join()
    finally:
        ledger_.dispose()
    assert schema_diff(pg_url) == []


# ------------------------------------------------------- PostgreSQL: many runs, one database


def test_runs_share_one_database_and_cross_run_sql_works(pg_url: str, tmp_path: Path) -> None:
    streams = {"model": Keep(last=2), "best": TopK(1, "val_loss")}
    runs = {"fast": 1e-2, "slow": 1e-4, "mid": 3e-3}
    managers = {
        name: CheckpointManager(tmp_path / name, db_url=pg_url, streams=streams) for name in runs
    }
    try:
        for step in (1, 2, 3):
            for name, lr in runs.items():  # interleaved: all three writers are open at once
                loss = lr * 100 / step if name != "mid" else 0.5 + step
                managers[name].log_metrics(step, {"lr": lr})
                managers[name].save(
                    step, metrics={"val_loss": loss}, model=state(step), best=state(step)
                )
    finally:
        for mgr in managers.values():
            mgr.close()
    query = (
        "SELECT r.name, b.step, b.path FROM best_checkpoints b JOIN runs r ON r.id = b.run_id "
        "WHERE b.rank = 1 AND b.run_id IN "
        "(SELECT run_id FROM metrics WHERE name = 'lr' AND value > 1e-3) ORDER BY r.name"
    )
    with RunReader(tmp_path / "slow", db_url=pg_url) as reader:  # any run's reader sees all
        assert [c.step for c in reader.checkpoints("model")] == [2, 3]
        _, found = reader.sql(query)
    assert found == [("fast", 3, "best/step-000000003.pt"), ("mid", 1, "best/step-000000001.pt")]
    out = ok(cli("sql", tmp_path / "fast", query, "--db-url", pg_url, "--format", "csv"))
    assert out.split() == ["name,step,path", "fast,3,best/step-000000003.pt", *out.split()[2:]]
    roots = {r for (r,) in ledger_rows(pg_url, "SELECT root FROM runs")}
    assert roots == {str((tmp_path / name).resolve()) for name in runs}


def test_a_run_is_identified_by_its_resolved_root(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointManager(tmp_path / "exp", db_url=pg_url) as mgr:
        mgr.save(1, model=state(1))
        run_id = mgr.run_id
    monkeypatch.chdir(tmp_path)
    with CheckpointManager("exp", db_url=pg_url) as again:  # relative: the same run
        assert again.run_id == run_id
        assert again.latest().step == 1
    (tmp_path / "alias").symlink_to(tmp_path / "exp")
    with pytest.raises(LedgerLockedError), CheckpointManager(tmp_path / "exp", db_url=pg_url):
        CheckpointManager(tmp_path / "alias", db_url=pg_url)  # a symlink: the same run too
    with CheckpointManager(tmp_path / "other", db_url=pg_url) as other:
        assert other.run_id != run_id
        assert other.latest() is None


def test_a_postgresql_url_without_a_driver_uses_psycopg(pg_url: str, root: Path) -> None:
    bare = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    assert bare != pg_url
    with CheckpointManager(root, db_url=bare) as mgr:
        mgr.save(1, model=state(1))
    with RunReader(root, db_url=bare) as reader:
        assert reader.latest().step == 1


def test_an_unreachable_server_is_a_ledger_error(root: Path) -> None:
    with pytest.raises(LedgerError, match="cannot connect"):
        CheckpointManager(root, db_url="postgresql+psycopg://nobody:secret@127.0.0.1:1/none")
    try:
        CheckpointManager(root, db_url="postgresql+psycopg://nobody:secret@127.0.0.1:1/none")
    except LedgerError as exc:
        assert "secret" not in str(exc)  # the password is masked in messages
    assert not (root / "ckptdb.lock").exists()


def test_a_reader_of_an_empty_database_says_so(pg_url: str, root: Path) -> None:
    with pytest.raises(LedgerError, match="no ckptdb schema"):
        RunReader(root, db_url=pg_url)


def test_network_filesystem_rule_does_not_apply_to_postgresql(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptdb.ledger.netfs
    from ckptdb.errors import NetworkFilesystemError

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nfiler:/export {tmp_path} nfs4 rw 0 0\n")
    monkeypatch.setattr(ckptdb.ledger.netfs, "MOUNTS_PATH", mounts)
    monkeypatch.delenv("CKPTDB_ALLOW_NETWORK_SQLITE", raising=False)
    root = tmp_path / "run"
    assert ckptdb.ledger.netfs.mount_of(root) == (str(tmp_path), "nfs4")
    with pytest.raises(NetworkFilesystemError):  # where a SQLite ledger is refused
        CheckpointManager(tmp_path / "sqlite-run")
    with CheckpointManager(root, db_url=pg_url) as mgr:  # checkpoints on NFS: fine
        saved = mgr.save(1, model=state(1))["model"]
        assert value_of(mgr.load("latest")) == 1
    # the save went through: the file on NFS, its committed row and the latest pointer
    # in the PostgreSQL ledger, and no SQLite ledger next to the checkpoints
    assert saved.path == root / "checkpoints" / "model" / "step-000000001.pt"
    assert saved.path.stat().st_size == saved.size
    assert ledger_rows(pg_url, "SELECT id, stream, step, state, path, size FROM checkpoints") == [
        (saved.id, "model", 1, "committed", "model/step-000000001.pt", saved.size)
    ]
    assert ledger_rows(pg_url, "SELECT name, checkpoint_id FROM pointers") == [
        ("latest:model", saved.id)
    ]
    assert files(root) == ["checkpoints/model/step-000000001.pt"]
