"""Small helpers shared by the tests (importable as ``helpers``)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.pool import NullPool


def state(value: float, n: int = 4) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), float(value)), "b": torch.tensor([float(value)])}


def rows(root: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Query the run's SQLite ledger directly, as any SQL client would."""
    con = sqlite3.connect(root / "ckptdb.sqlite")
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def files(directory: Path) -> list[str]:
    """Every file under ``directory``, relative, sorted (symlinks included)."""
    if not directory.exists():
        return []
    return sorted(
        str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() or p.is_symlink()
    )


def ledger_rows(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """Query any ledger (SQLite or PostgreSQL URL) directly, with ``:name`` parameters."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def pg_schema_url(url: str, schema: str) -> str:
    """``url`` with every connection's ``search_path`` set to ``schema``."""
    options = {"options": f"-csearch_path={schema}"}
    return make_url(url).update_query_dict(options).render_as_string(hide_password=False)


@contextlib.contextmanager
def pg_admin(url: str) -> Iterator[Connection]:
    """An autocommit connection to the test server (schemas, pg_terminate_backend...)."""
    engine = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def hammer(root: str, db_url: str, stop: str, out: str) -> None:
    """A reader process: query ``latest``/``sql`` in a loop until ``stop`` exists.

    Writes to ``out`` a JSON report: how many observations, and every
    violation seen (a latest checkpoint whose file is missing or incomplete,
    "latest" or the committed count going backwards). Every few rounds the
    reader is reopened, as a fresh ``ckptdb`` command would.
    """
    from ckptdb.reader import RunReader

    url = db_url or None
    seen: list[int] = []
    violations: list[str] = []
    rounds = last_step = last_count = 0
    Path(out + ".ready").touch()
    while not Path(stop).exists():
        with RunReader(root, db_url=url) as reader:
            for _ in range(5):
                found = reader.latest("model")
                if found is not None:
                    size = found.path.stat().st_size if found.path.exists() else None
                    if size != found.size:
                        violations.append(f"latest {found.path}: size {size} != {found.size}")
                    if found.step < last_step:
                        violations.append(f"latest went back: {last_step} -> {found.step}")
                    last_step = found.step
                    seen.append(found.step)
                _, result = reader.sql(
                    "SELECT COUNT(*), MAX(step) FROM checkpoints "
                    "WHERE stream = 'model' AND state = 'committed'"
                )
                count, newest = result[0]
                if count < last_count:
                    violations.append(f"committed count went back: {last_count} -> {count}")
                if found is not None and (newest is None or newest < found.step):
                    violations.append(f"sql saw max step {newest} after latest {found.step}")
                last_count = count
                rounds += 1
        time.sleep(0.001)
    Path(out).write_text(json.dumps({"rounds": rounds, "seen": seen, "violations": violations}))
