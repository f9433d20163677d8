"""A read-only ledger connection refuses every write, the ones ``query_only`` misses too."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from ckptdb.sqliteread import lock_read_only


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO t VALUES (2)",
        "CREATE TABLE u (x)",
        "ATTACH DATABASE '{tmp}/new.db' AS new",
        "VACUUM INTO '{tmp}/copy.db'",
        "DETACH DATABASE temp",
        "PRAGMA query_only = OFF; INSERT INTO t VALUES (3)",
        "PRAGMA QUERY_ONLY = 0; INSERT INTO t VALUES (3)",
        "PRAGMA main.query_only = false; INSERT INTO t VALUES (3)",
    ],
)
def test_a_locked_connection_writes_nothing_anywhere(tmp_path: Path, statement: str) -> None:
    """Opened read-write on purpose: the lock alone must hold (both readers add ``mode=ro``)."""
    ledger = tmp_path / "ledger.sqlite"
    with closing(sqlite3.connect(ledger)) as db:
        db.execute("CREATE TABLE t (x)")
        db.execute("INSERT INTO t VALUES (1)")
        db.commit()
    before = ledger.read_bytes()
    with closing(sqlite3.connect(ledger, isolation_level=None)) as db:
        lock_read_only(db)
        with pytest.raises(sqlite3.DatabaseError):
            db.executescript(statement.format(tmp=tmp_path))
        assert db.execute("SELECT x FROM t").fetchall() == [(1,)]  # reads still work
    assert ledger.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.sqlite"]


def test_a_locked_connection_still_reads_its_pragmas(tmp_path: Path) -> None:
    with closing(sqlite3.connect(tmp_path / "ledger.sqlite", isolation_level=None)) as db:
        db.execute("CREATE TABLE t (x INTEGER)")
        lock_read_only(db)
        assert db.execute("PRAGMA query_only").fetchall() == [(1,)]
        assert [row[1] for row in db.execute("PRAGMA table_info(t)")] == ["x"]
