"""The ledger itself: writer lock, schema versions, migrations, SQLite settings, SQL contract."""

from __future__ import annotations

import json
import os
import pprint
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from filelock import FileLock
from helpers import CHILD_TIMEOUT, files, rows, run_script, schema_diff, sha256, state, value_of
from sqlalchemy import create_engine, inspect

from ckptdb import CheckpointManager, Keep, TopK
from ckptdb.errors import (
    CkptDBError,
    InvalidArgumentError,
    LedgerLockedError,
    SchemaVersionError,
)
from ckptdb.ledger.engine import alembic_config, create_ledger_engine

REPO = Path(__file__).resolve().parents[1]
TABLES = {"runs", "attempts", "streams", "checkpoints", "pointers", "metrics", "events"}
VIEWS = {"latest_checkpoints", "best_checkpoints"}
LOWER_WORD = re.compile(r"[a-z]+(_[a-z]+)*")


def head_revision() -> str:
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    assert len(heads) == 1, heads
    return heads[0]


def wal_checkpoint(db: Path) -> None:
    con = sqlite3.connect(db)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    finally:
        con.close()


def assert_schema_matches_models(url: str) -> None:
    diff = schema_diff(url)
    if diff:
        pytest.fail(
            "the migrated schema differs from ckptdb.ledger.models:\n"
            + pprint.pformat(diff, width=100)
        )


def sqlite_objects(db: Path, kind: str) -> set[str]:
    con = sqlite3.connect(db)
    try:
        found = con.execute("SELECT name FROM sqlite_master WHERE type = ?", (kind,)).fetchall()
    finally:
        con.close()
    return {name for (name,) in found}


# ---------------------------------------------------------------- writer lock

LOCKED_CHILD = """
    import json, sys
    from ckptdb import CheckpointManager
    from ckptdb.errors import LedgerLockedError
    try:
        mgr = CheckpointManager(sys.argv[1])
    except LedgerLockedError as exc:
        print(json.dumps({"message": str(exc), "holder": exc.holder}))
        sys.exit(3)
    mgr.close()
    print(json.dumps({"opened": True}))
"""


def test_second_process_is_refused_at_once_naming_the_holder(root, open_manager, tmp_path):
    mgr = open_manager()
    mgr.save(1, model=state(1))

    # The lock is taken with no waiting: if the child blocked on it, the
    # subprocess timeout (far below pytest's) would fail the test.
    result = run_script(tmp_path, LOCKED_CHILD, str(root))

    assert result.returncode == 3, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert str(os.getpid()) in report["message"]
    assert socket.gethostname() in report["message"]
    assert report["holder"]["pid"] == os.getpid()
    assert report["holder"]["host"] == socket.gethostname()
    # The refused process changed nothing: still one attempt, still running.
    assert rows(root, "SELECT pid, end_state FROM attempts") == [(os.getpid(), "running")]


def test_second_manager_in_same_process_is_refused(root, open_manager):
    first = open_manager()
    with pytest.raises(LedgerLockedError) as info:
        CheckpointManager(root)
    assert isinstance(info.value, CkptDBError)
    assert info.value.holder["pid"] == os.getpid()
    assert info.value.holder["host"] == socket.gethostname()
    assert str(os.getpid()) in str(info.value)
    # The refusal did not disturb the holder.
    first.save(1, model=state(1))
    assert first.latest().step == 1
    assert len(rows(root, "SELECT id FROM attempts")) == 1


def test_lock_is_free_again_after_close(root):
    first = CheckpointManager(root)
    first.close()
    second = CheckpointManager(root)
    try:
        with pytest.raises(LedgerLockedError):
            CheckpointManager(root)
    finally:
        second.close()
    CheckpointManager(root).close()


def test_the_lock_is_the_file_ckptdb_lock_in_the_root(root):
    root.mkdir(parents=True)
    foreign = FileLock(str(root / "ckptdb.lock"), timeout=0)
    foreign.acquire()
    try:
        with pytest.raises(LedgerLockedError):
            CheckpointManager(root)
    finally:
        foreign.release()
    CheckpointManager(root).close()


HOLDER_CHILD = """
    import sys, time
    import torch
    from ckptdb import CheckpointManager
    mgr = CheckpointManager(sys.argv[1])
    mgr.save(7, model={"w": torch.full((4,), 7.0)})
    print("ready", flush=True)
    time.sleep(600)
"""


def test_lock_is_released_when_the_holder_is_killed(root, tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent(HOLDER_CHILD))
    child = subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        line = child.stdout.readline()
        if line.strip() != "ready":
            child.kill()
            pytest.fail(f"holder did not start: {line!r} {child.communicate()[1]}")
        with pytest.raises(LedgerLockedError) as info:
            CheckpointManager(root)
        assert info.value.holder["pid"] == child.pid
        assert str(child.pid) in str(info.value)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=CHILD_TIMEOUT)
    assert child.returncode == -signal.SIGKILL

    with CheckpointManager(root) as mgr:
        assert mgr.latest().step == 7
        assert mgr.load()["w"][0].item() == 7.0
        attempts = rows(root, "SELECT pid, end_state, ended_at FROM attempts ORDER BY id")
        assert [(pid, end) for pid, end, _ in attempts] == [
            (child.pid, "crashed"),
            (os.getpid(), "running"),
        ]
        assert attempts[0][2] is not None


# ------------------------------------------------------------ schema versions


def test_unknown_schema_revision_is_refused_and_the_ledger_left_untouched(root):
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1))
    db = root / "ckptdb.sqlite"
    con = sqlite3.connect(db)
    con.execute("UPDATE alembic_version SET version_num = 'ffff_future'")
    con.commit()
    con.close()
    wal_checkpoint(db)
    before = sha256(db)
    attempts = rows(root, "SELECT * FROM attempts")
    checkpoint_files = files(root / "checkpoints")

    with pytest.raises(SchemaVersionError) as info:
        CheckpointManager(root)
    assert isinstance(info.value, CkptDBError)
    assert "ffff_future" in str(info.value)

    wal_checkpoint(db)
    assert sha256(db) == before
    assert rows(root, "SELECT * FROM attempts") == attempts
    assert rows(root, "SELECT version_num FROM alembic_version") == [("ffff_future",)]
    assert files(root / "checkpoints") == checkpoint_files
    # The failed open released the writer lock: a retry meets the schema again, not the lock.
    with pytest.raises(SchemaVersionError):
        CheckpointManager(root)


# ----------------------------------------------------------------- migrations


def test_migrated_schema_matches_the_models(root):
    CheckpointManager(root).close()
    assert_schema_matches_models(f"sqlite:///{root / 'ckptdb.sqlite'}")


def test_schema_diff_detects_a_drift(tmp_path):
    # Guard for the snapshot test above: a schema that lacks a column is reported.
    db = tmp_path / "drift.sqlite"
    cfg = alembic_config()
    engine = create_ledger_engine(f"sqlite:///{db}")
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
            conn.exec_driver_sql("ALTER TABLE checkpoints DROP COLUMN error")
    finally:
        engine.dispose()
    diff = schema_diff(f"sqlite:///{db}")
    assert any(d[0] == "add_column" and d[3].name == "error" for d in diff), diff


def test_downgrade_to_base_then_upgrade_to_head(tmp_path):
    db = tmp_path / "ledger.sqlite"
    url = f"sqlite:///{db}"
    cfg = alembic_config()
    engine = create_ledger_engine(url)
    try:
        for target in ("head", "base"):
            with engine.begin() as conn:
                cfg.attributes["connection"] = conn
                getattr(command, "upgrade" if target == "head" else "downgrade")(cfg, target)
        assert sqlite_objects(db, "table") & (TABLES | VIEWS) == set()
        assert sqlite_objects(db, "view") == set()
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    finally:
        engine.dispose()
    assert sqlite_objects(db, "table") >= TABLES
    assert sqlite_objects(db, "view") >= VIEWS
    assert_schema_matches_models(url)
    # A ledger built this way is usable by the manager.
    with CheckpointManager(tmp_path / "run", db_url=url) as mgr:
        mgr.save(1, model=state(1))
        assert mgr.latest().step == 1


def test_views_answer_latest_and_best(root, open_manager):
    mgr = open_manager(
        streams={
            "model": Keep(last=3),
            "best": TopK(2, "acc", mode="max"),
            "low": TopK(2, "loss"),
        }
    )
    boundaries = [(1, 0.5, 0.3), (2, 0.9, 0.4), (3, 0.7, 0.1), (4, 0.9, 0.2)]
    for step, acc, loss in boundaries:
        mgr.save(
            step,
            metrics={"acc": acc, "loss": loss},
            model=state(step),
            best=state(step),
            low=state(step),
        )

    best = rows(
        root,
        "SELECT stream, rank, step, metric, mode FROM best_checkpoints ORDER BY stream, rank",
    )
    assert best == [
        # mode='max': the highest accuracy first; the tie 0.9 goes to the earlier step
        ("best", 1, 2, 0.9, "max"),
        ("best", 2, 4, 0.9, "max"),
        ("low", 1, 3, 0.1, "min"),
        ("low", 2, 4, 0.2, "min"),
    ]
    assert [c.step for c in mgr.best("best")] == [2, 4]
    assert [c.step for c in mgr.best("low")] == [3, 4]

    latest = rows(root, "SELECT stream, step, path FROM latest_checkpoints ORDER BY stream")
    assert [(s, step) for s, step, _ in latest] == [("best", 4), ("low", 4), ("model", 4)]
    model_path = next(p for s, _, p in latest if s == "model")
    assert mgr.save_dir / model_path == mgr.latest("model").path

    # A new boundary that is worse for both top-K streams moves only the model pointer.
    mgr.save(5, metrics={"acc": 0.1, "loss": 9.0}, model=state(5), best=state(5), low=state(5))
    latest = rows(root, "SELECT stream, step FROM latest_checkpoints ORDER BY stream")
    assert latest == [("best", 4), ("low", 4), ("model", 5)]
    assert rows(root, "SELECT count(*) FROM best_checkpoints") == [(4,)]


def alembic_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "alembic"
    return subprocess.run(
        [str(exe), "-c", "alembic.ini", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )


def test_alembic_cli_upgrades_the_url_given_with_x(tmp_path):
    target = tmp_path / "x.sqlite"
    decoy = tmp_path / "decoy.sqlite"
    env = dict(os.environ, CKPTDB_DB_URL=f"sqlite:///{decoy}")  # -x takes precedence
    result = alembic_cli("-x", f"db_url=sqlite:///{target}", "upgrade", "head", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sqlite_objects(target, "table") >= TABLES
    assert sqlite_objects(target, "view") >= VIEWS
    con = sqlite3.connect(target)
    try:
        assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [
            (head_revision(),)
        ]
    finally:
        con.close()
    assert not decoy.exists()


def test_alembic_cli_reads_ckptdb_db_url(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    target = root / "ckptdb.sqlite"
    env = dict(os.environ, CKPTDB_DB_URL=f"sqlite:///{target}")
    result = alembic_cli("upgrade", "head", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sqlite_objects(target, "table") >= TABLES
    # The manager accepts a ledger created by the CLI as current.
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1))
    assert rows(root, "SELECT step, state FROM checkpoints") == [(1, "committed")]


# ------------------------------------------------------------ SQLite settings


def test_sqlite_connection_settings(open_manager, root):
    mgr = open_manager()
    with mgr._ctx.ledger.engine.connect() as conn:

        def pragma(name: str) -> Any:
            return conn.exec_driver_sql(f"PRAGMA {name}").scalar()

        assert str(pragma("journal_mode")).lower() == "wal"
        assert pragma("synchronous") == 2  # FULL
        assert pragma("foreign_keys") == 1
        assert pragma("busy_timeout") > 0
    # WAL is a property of the file, so any client sees it.
    assert rows(root, "PRAGMA journal_mode") == [("wal",)]


def test_alembic_default_version_table(open_manager, root):
    open_manager()
    assert "alembic_version" in sqlite_objects(root / "ckptdb.sqlite", "table")
    assert rows(root, "SELECT version_num FROM alembic_version") == [(head_revision(),)]


# ------------------------------------------------------- SQL history contract


def test_tables_and_columns_of_the_sql_contract(open_manager, root):
    open_manager()
    engine = create_engine(f"sqlite:///{root / 'ckptdb.sqlite'}")
    try:
        insp = inspect(engine)
        assert set(insp.get_table_names()) >= TABLES
        assert set(insp.get_view_names()) >= VIEWS
        required = {
            "checkpoints": {"stream", "step", "state", "path", "size", "hash", "metric"},
            "metrics": {"step", "name", "value"},
            "events": {"kind"},
            "attempts": {"host", "pid", "resumed_from_id", "end_state", "ended_at"},
            "streams": {"name", "kind"},
            "pointers": {"name", "checkpoint_id"},
            "runs": {"root"},
        }
        for table, columns in required.items():
            have = {c["name"] for c in insp.get_columns(table)}
            assert columns <= have, f"{table} lacks {sorted(columns - have)}"
    finally:
        engine.dispose()


def test_paths_are_relative_to_save_dir_and_words_are_lower_case(tmp_path, open_manager):
    root = tmp_path / "run"
    save_dir = tmp_path / "elsewhere" / "ckpts"
    mgr = open_manager(
        root, save_dir=save_dir, streams={"model": Keep(last=1), "best": TopK(1, "loss")}
    )
    for step in (1, 2, 3):
        mgr.save(step, metrics={"loss": 1.0 / step}, model=state(step), best=state(step))
    mgr.load("latest")

    paths = rows(root, "SELECT path FROM checkpoints WHERE state = 'committed' ORDER BY stream")
    assert len(paths) == 2
    for (path,) in paths:
        assert not Path(path).is_absolute() and ".." not in Path(path).parts
        assert (save_dir / path).is_file()
    assert {str(c.path) for c in mgr.checkpoints()} == {str(save_dir / p) for (p,) in paths}

    states = {s for (s,) in rows(root, "SELECT DISTINCT state FROM checkpoints")}
    assert {"committed", "deleted"} <= states
    kinds = {k for (k,) in rows(root, "SELECT DISTINCT kind FROM events")}
    assert {"attempt_started", "resumed"} <= kinds
    for word in states | kinds:
        assert LOWER_WORD.fullmatch(word), word
    assert rows(root, "SELECT root, save_dir FROM runs") == [(str(root), str(save_dir))]


# ------------------------------------------------------------ stored policies


def stored_streams(root: Path) -> dict[str, tuple[Any, ...]]:
    found = rows(root, "SELECT name, kind, keep_last, keep_every, k, metric, mode FROM streams")
    return {row[0]: tuple(row[1:]) for row in found}


def test_a_new_run_gets_the_default_policy(open_manager, root):
    mgr = open_manager()
    assert mgr.policies == {"model": Keep(last=5)}
    assert stored_streams(root) == {"model": ("keep", 5, None, None, None, None)}


def test_opening_without_streams_uses_the_stored_ones(root, streams):
    with CheckpointManager(root, streams=streams) as mgr:
        assert mgr.policies == streams
    with CheckpointManager(root) as mgr:
        assert mgr.policies == streams
        mgr.save(1, metrics={"val_loss": 0.5}, ema=state(1), best=state(1))
        assert set(mgr.save(2, metrics={"val_loss": 0.4}, best=state(2))) == {"best"}
    assert set(stored_streams(root)) == set(streams)


def test_streams_update_the_named_ones_and_keep_the_others(root, streams):
    with CheckpointManager(root, streams=streams) as mgr:
        for step in (1, 2):
            mgr.save(
                step,
                metrics={"val_loss": 1.0 / step},
                model=state(step),
                ema=state(step),
                best=state(step),
            )
        kept = [c for c in mgr.checkpoints() if c.stream in ("ema", "best")]
        assert len(kept) == 4

    with CheckpointManager(root, streams={"model": Keep(last=1)}) as mgr:
        assert mgr.policies == {
            "model": Keep(last=1),
            "ema": Keep(last=2),
            "best": TopK(2, "val_loss"),
        }
        # Nothing was deleted because the caller did not mention ema and best.
        assert [c for c in mgr.checkpoints() if c.stream in ("ema", "best")] == kept
        assert all(c.path.is_file() for c in kept)
        assert mgr.last_reconcile.actions == []
        mgr.save(3, model=state(3))  # the new model policy applies
        assert [c.step for c in mgr.checkpoints("model")] == [3]
        assert [c for c in mgr.checkpoints() if c.stream in ("ema", "best")] == kept
        # The stored streams can still be written to.
        mgr.save(3, metrics={"val_loss": 0.1}, ema=state(3), best=state(3))
        assert [c.step for c in mgr.best()] == [3, 2]

    stored = stored_streams(root)
    assert stored["model"] == ("keep", 1, None, None, None, None)
    assert stored["ema"] == ("keep", 2, None, None, None, None)
    assert stored["best"] == ("topk", None, None, 2, "val_loss", "min")


def test_changing_a_stream_to_topk_is_refused_or_honoured(root):
    with CheckpointManager(root, streams={"model": Keep(last=3)}) as mgr:
        mgr.save(1, metrics={"loss": 1.0}, model=state(1))
        mgr.save(2, model=state(2))  # a Keep boundary needs no metric
    try:
        mgr = CheckpointManager(root, streams={"model": TopK(2, "loss")})
    except InvalidArgumentError:
        # Refusing the change is fine, provided the stored policy is untouched.
        assert stored_streams(root)["model"] == ("keep", 3, None, None, None, None)
        return
    with mgr:
        mgr.save(3, metrics={"loss": 0.5}, model=state(3))
        best = mgr.best("model")
        assert best[0].step == 3
        assert all(c.path.is_file() for c in best)


def test_changing_the_topk_metric_is_refused_or_ranks_by_the_new_metric(root):
    with CheckpointManager(root, streams={"best": TopK(2, "val_loss")}) as mgr:
        mgr.save(1, metrics={"val_loss": 0.9, "acc": 0.2}, best=state(1))
        mgr.save(2, metrics={"val_loss": 0.1, "acc": 0.95}, best=state(2))
    try:
        mgr = CheckpointManager(root, streams={"best": TopK(2, "acc", mode="max")})
    except InvalidArgumentError:
        assert stored_streams(root)["best"] == ("topk", None, None, 2, "val_loss", "min")
        return
    with mgr:
        # Ranked by accuracy, step 2 (0.95) is the best; a new 0.5 evicts step 1 (0.2).
        assert [c.step for c in mgr.best()] == [2, 1]
        mgr.save(3, metrics={"val_loss": 0.5, "acc": 0.5}, best=state(3))
        best = mgr.best()
        assert [c.step for c in best] == [2, 3]
        assert all(c.path.is_file() for c in best)
        assert value_of(mgr.load("best")) == 2


# -------------------------------------------------------------------- attempts


def attempts(root: Path) -> list[tuple[Any, ...]]:
    return rows(root, "SELECT id, host, pid, end_state, started_at, ended_at FROM attempts")


def test_each_open_records_an_attempt_and_close_ends_it(root):
    mgr = CheckpointManager(root)
    try:
        [(aid, host, pid, end_state, started, ended)] = attempts(root)
        assert aid == mgr.attempt_id
        assert (host, pid, end_state, ended) == (socket.gethostname(), os.getpid(), "running", None)
        assert started is not None
    finally:
        mgr.close()
    [(_, _, _, end_state, started, ended)] = attempts(root)
    assert end_state == "closed"
    assert ended is not None and ended >= started

    with CheckpointManager(root) as second:
        assert second.attempt_id != aid
    assert [(a[0], a[3]) for a in attempts(root)] == [
        (aid, "closed"),
        (second.attempt_id, "closed"),
    ]


def test_leaving_the_context_by_an_exception_marks_the_attempt_failed(root):
    class Boom(Exception):
        pass

    with pytest.raises(Boom), CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1))
        raise Boom
    [(_, _, _, end_state, _, ended)] = attempts(root)
    assert end_state == "failed"
    assert ended is not None
    # The lock was released on the way out.
    with CheckpointManager(root) as again:
        assert again.latest().step == 1


def test_an_open_that_fails_after_locking_releases_the_lock(root, monkeypatch):
    import ckptdb.manager

    def failing_reconcile(self: Any, **kwargs: Any) -> Any:
        raise OSError("disk on fire")

    with monkeypatch.context() as patch:
        patch.setattr(ckptdb.manager.Reconciler, "run", failing_reconcile)
        with pytest.raises(OSError, match="disk on fire") as info:
            CheckpointManager(root)
    # The error (and with it the half-built manager) is still alive here, so a
    # lock released only by garbage collection would still be held.
    assert info.value is not None
    [(_, _, _, end_state, _, ended)] = attempts(root)
    assert end_state != "running"
    assert ended is not None
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1))


CRASH_CHILD = """
    import os, sys
    from ckptdb import CheckpointManager
    mgr = CheckpointManager(sys.argv[1])
    mgr.log_metrics(1, {"loss": 1.0})
    print(mgr.attempt_id, flush=True)
    os._exit(0)  # no close(): the process dies with its attempt running
"""


def test_a_crashed_attempt_is_marked_at_the_next_open(root, tmp_path):
    result = run_script(tmp_path, CRASH_CHILD, str(root))
    assert result.returncode == 0, result.stderr
    crashed_id = int(result.stdout.split()[-1])
    assert [(a[0], a[3], a[5]) for a in attempts(root)] == [(crashed_id, "running", None)]

    with CheckpointManager(root) as mgr:
        found = {a[0]: a for a in attempts(root)}
        assert found[crashed_id][3] == "crashed"
        assert found[crashed_id][5] is not None
        assert found[mgr.attempt_id][3] == "running"
    assert [a[3] for a in attempts(root)] == ["crashed", "closed"]


# --------------------------------------------------------------------- metrics


def test_logged_metrics_are_written_on_commit_and_close_with_their_attempt(root):
    with CheckpointManager(root) as mgr:
        mgr.log_metrics(1, {"loss": 0.5, "lr": 3})
        mgr.save(2, metrics={"loss": 0.25}, model=state(2))
        committed = rows(root, "SELECT step, name, value FROM metrics ORDER BY step, name")
        assert committed == [(1, "loss", 0.5), (1, "lr", 3.0), (2, "loss", 0.25)]
        mgr.log_metrics(3, {"loss": 0.125})
        attempt_id = mgr.attempt_id
    found = rows(root, "SELECT attempt_id, step, name, value, typeof(value) FROM metrics")
    assert sorted(found) == [
        (attempt_id, 1, "loss", 0.5, "real"),
        (attempt_id, 1, "lr", 3.0, "real"),
        (attempt_id, 2, "loss", 0.25, "real"),
        (attempt_id, 3, "loss", 0.125, "real"),
    ]


def test_metrics_of_two_attempts_are_told_apart(root):
    ids = []
    for value in (1.0, 0.5):
        with CheckpointManager(root) as mgr:
            mgr.log_metrics(10, {"loss": value})
            ids.append(mgr.attempt_id)
    assert ids[0] != ids[1]
    found = rows(
        root,
        "SELECT a.id, a.end_state, m.value FROM metrics m JOIN attempts a ON a.id = m.attempt_id "
        "WHERE m.name = 'loss' AND m.step = 10 ORDER BY a.id",
    )
    assert found == [(ids[0], "closed", 1.0), (ids[1], "closed", 0.5)]


def test_only_the_commit_transaction_pays_for_an_fsync(open_manager) -> None:
    """synchronous=FULL for the boundary's commit; NORMAL for intent and cleanup,
    whose loss to a power cut reconcile repairs (see Ledger.transaction)."""
    from sqlalchemy import event

    from ckptdb import Keep

    mgr = open_manager(streams={"model": Keep(last=1)})
    mgr.save(1, model=state(1))
    levels: list[int] = []

    def record(connection) -> None:
        levels.append(connection.exec_driver_sql("PRAGMA synchronous").scalar())

    event.listen(mgr._ctx.ledger.engine, "begin", record)
    try:
        mgr.save(2, model=state(2))  # intent, commit (evicts step 1), cleanup
    finally:
        event.remove(mgr._ctx.ledger.engine, "begin", record)
    assert levels == [1, 2, 1]  # NORMAL, FULL, NORMAL
