"""Schema migrations on ledgers users already have: 0001 (release 0.1) -> head, and back.

``tests/data/ledger-0001.sqlite`` is a run written by ckptdb at schema 0001
(``tests/data/make_ledger_0001.py`` says how): attempts (one crashed), keep and
top-K streams, evictions, a rolled-back boundary, a corrupt checkpoint,
metrics and events. On PostgreSQL the same rows are loaded into a schema
that revision 0001 created. Upgrading keeps every row; downgrading removes
only what 0002 added; a reader meets an old schema with a clear error.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from helpers import ledger_objects, migrate_to
from sqlalchemy import MetaData, create_engine, inspect, select, text
from sqlalchemy.pool import NullPool

from ckptdb import CheckpointManager, RunReader
from ckptdb.errors import SchemaVersionError
from ckptdb.ledger.engine import newest_revision

pytestmark = pytest.mark.usefixtures("no_db_url_from_environment")

FIXTURE = Path(__file__).parent / "data" / "ledger-0001.sqlite"
TABLES_0001 = ("runs", "attempts", "streams", "checkpoints", "pointers", "metrics", "events")
ADDED = {"pins", "evaluations"}


def snapshot(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of 0001's tables, ordered, with values as the database returns them:
    0001's columns only (later revisions add columns, whose new values are theirs)."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            found = {}
            for table in TABLES_0001:
                present = {c["name"] for c in inspect(conn).get_columns(table)}
                columns = sorted(present - COLUMNS_AFTER_0001.get(table, set()))
                rows = conn.execute(text(f"SELECT {', '.join(columns)} FROM {table}"))
                found[table] = sorted((tuple(map(_plain, r)) for r in rows), key=repr)
            return found
    finally:
        engine.dispose()


#: The columns revisions after 0001 added to 0001's tables.
COLUMNS_AFTER_0001 = {
    "attempts": {
        "world_size",
        "launched_at",
        "first_step_at",
        "last_step",
        "seen_at",
        "saving_s",
        "saves",
    },
    "checkpoints": {"world_size", "topology", "saving_before_s"},
}


def _plain(value: Any) -> Any:
    """Dates compare as text: SQLite keeps strings, PostgreSQL gives datetimes."""
    return value.isoformat(sep=" ") if hasattr(value, "isoformat") else value


def definitions(url: str) -> dict[str, Any]:
    """The SQL of every view and index (and each table's columns), as the database
    reports them: what a downgrade must restore exactly."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            found: dict[str, Any] = {
                f"view {v}": " ".join(insp.get_view_definition(v).split())
                for v in insp.get_view_names()
            }
            for table in insp.get_table_names():
                indexes = sorted(
                    (i["name"], tuple(i["column_names"]), bool(i["unique"]))
                    for i in insp.get_indexes(table)
                )
                found[f"indexes {table}"] = indexes
                found[f"columns {table}"] = [
                    (c["name"], str(c["type"])) for c in insp.get_columns(table)
                ]
            return found
    finally:
        engine.dispose()


@pytest.fixture
def old_sqlite(tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "run"
    root.mkdir()
    shutil.copyfile(FIXTURE, root / "ckptdb.sqlite")
    con = sqlite3.connect(root / "ckptdb.sqlite")
    with con:  # rooted here, as if it had been written here (moving a run is tested elsewhere)
        con.execute(
            "UPDATE runs SET root = ?, save_dir = ?",
            (str(root.resolve()), str(root.resolve() / "checkpoints")),
        )
    con.close()
    return root, f"sqlite:///{root / 'ckptdb.sqlite'}"


@pytest.fixture
def old_postgres(tmp_path: Path, pg_url: str) -> tuple[Path, str]:
    """Revision 0001's schema in PostgreSQL, holding the fixture's rows (the run
    re-rooted at a directory of this test)."""
    root = tmp_path / "run"
    root.mkdir()
    migrate_to(pg_url, "0001")
    source = create_engine(f"sqlite:///{FIXTURE}", poolclass=NullPool)
    target = create_engine(pg_url, poolclass=NullPool)
    try:
        meta = MetaData()
        meta.reflect(bind=target, only=list(TABLES_0001))
        with source.connect() as src, target.begin() as dst:
            for table in TABLES_0001:
                rows = [dict(r._mapping) for r in src.execute(select(meta.tables[table]))]
                if rows:
                    dst.execute(meta.tables[table].insert(), rows)
                if "id" in meta.tables[table].c:
                    dst.execute(
                        text(
                            f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                            f"(SELECT COALESCE(MAX(id), 1) FROM {table}))"
                        )
                    )
            dst.execute(
                text("UPDATE runs SET root = :root, save_dir = :save_dir"),
                {"root": str(root.resolve()), "save_dir": str(root.resolve() / "checkpoints")},
            )
    finally:
        source.dispose()
        target.dispose()
    return root, pg_url


@pytest.fixture(params=["sqlite", "postgres"])
def old_ledger(request: pytest.FixtureRequest) -> tuple[Path, str]:
    fixture = "old_sqlite" if request.param == "sqlite" else "old_postgres"
    found: tuple[Path, str] = request.getfixturevalue(fixture)
    return found


def test_the_fixture_is_a_populated_0001_ledger(old_ledger: tuple[Path, str]) -> None:
    _, url = old_ledger
    tables, views, version = ledger_objects(url)
    assert version == "0001" and not tables & ADDED and "checkpoint_evaluations" not in views
    rows = snapshot(url)
    states = {
        r[-4] for r in rows["checkpoints"]
    }  # columns sorted: ..., state, step, stream, tmp_path
    assert {"committed", "deleted", "aborted", "corrupt"} <= states
    assert len(rows["attempts"]) == 3 and rows["metrics"] and rows["events"]


def test_a_reader_meeting_the_old_schema_says_what_to_run(old_ledger: tuple[Path, str]) -> None:
    root, url = old_ledger
    db_url = None if url.startswith("sqlite") else url
    with pytest.raises(SchemaVersionError, match=r"ckptdb db upgrade") as caught:
        RunReader(root, db_url=db_url)
    assert "0001" in str(caught.value) and newest_revision() in str(caught.value)
    assert ledger_objects(url)[2] == "0001"  # a reader never migrates


def test_opening_the_run_upgrades_it_and_nothing_is_lost(old_ledger: tuple[Path, str]) -> None:
    root, url = old_ledger
    db_url = None if url.startswith("sqlite") else url
    before = snapshot(url)
    with CheckpointManager(root, db_url=db_url, maintenance=True) as mgr:
        tables, views, version = ledger_objects(url)
        assert version == newest_revision()
        assert tables >= ADDED and "checkpoint_evaluations" in views
        streams = sorted(mgr.policies)
    after = snapshot(url)
    for table in TABLES_0001:
        if table == "attempts":  # the maintenance attempt is the one new row
            assert set(before[table]) < set(after[table]) and len(after[table]) == 4
        elif table == "events":
            assert set(before[table]) <= set(after[table])
        else:
            assert after[table] == before[table], table
    assert streams == ["all", "best", "model"]
    with RunReader(root, db_url=db_url) as reader:  # the new schema now reads
        assert [c.step for c in reader.best("best")] == [7, 4]
        reader.record_evaluation(reader.latest(), {"acc": 0.5}, evaluator="e")
        assert [c.step for c, _, _ in reader.best_by("acc")] == [7]


def test_downgrading_removes_only_what_0002_added(old_ledger: tuple[Path, str]) -> None:
    root, url = old_ledger
    db_url = None if url.startswith("sqlite") else url
    before, shape = snapshot(url), definitions(url)
    migrate_to(url, "head")
    with RunReader(root, db_url=db_url) as reader:
        reader.record_evaluation(reader.latest(), {"acc": 0.5}, evaluator="e")
    migrate_to(url, "0001", down=True)
    tables, views, version = ledger_objects(url)
    assert version == "0001" and not tables & ADDED
    assert "checkpoint_evaluations" not in views and "best_checkpoints" in views
    assert snapshot(url) == before
    assert definitions(url) == shape  # every view and index exactly as 0001 made it
    migrate_to(url, "head")  # and up again
    assert ledger_objects(url)[2] == newest_revision()


def test_the_best_view_leaves_out_checkpoints_saved_without_the_metric(tmp_path: Path) -> None:
    """A TopK(last=N) stream may hold unscored checkpoints; 0002's view ranks only the
    scored ones (on SQLite a NULL would otherwise sort first and take rank 1)."""
    from helpers import state

    from ckptdb import TopK

    root = tmp_path / "run"
    with CheckpointManager(root, streams={"ckpt": TopK(1, "loss", last=3)}) as mgr:
        mgr.save(1, ckpt=state(1.0))
        mgr.save(2, metrics={"loss": 0.4}, ckpt=state(2.0))
        mgr.save(3, ckpt=state(3.0))
    with RunReader(root) as reader:
        _, ranked = reader.sql("SELECT step, rank FROM best_checkpoints ORDER BY rank")
    assert ranked == [(2, 1)]
