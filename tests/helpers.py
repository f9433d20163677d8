"""Small helpers shared by the tests (importable as ``helpers``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy.exc
import torch
import xxhash
from alembic import command
from click.testing import CliRunner, Result
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.pool import NullPool

from ckptdb.cli import main
from ckptdb.ledger.engine import alembic_config

CHILD_TIMEOUT = 90  # seconds; generous for a cold torch import, far below pytest's timeout


def state(value: float, n: int = 4) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), float(value)), "b": torch.tensor([float(value)])}


def value_of(loaded: dict[str, Any]) -> float:
    """The value a :func:`state` payload was made with."""
    return float(loaded["b"][0])


def boundary(value: float) -> dict[str, Any]:
    """Payloads for every stream of the ``streams`` fixture (model, ema, best), in that order."""
    return {"model": state(value), "ema": state(value + 0.5), "best": state(value + 0.25)}


def rows(root: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Query the run's SQLite ledger directly, as any SQL client would."""
    con = sqlite3.connect(root / "ckptdb.sqlite")
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


class LedgerClient:
    """Plain SQL on one run's ledger, SQLite or PostgreSQL, as any SQL client would.

    ``db_url`` is what the run was opened with: None for its own
    ``<root>/ckptdb.sqlite`` (read with :mod:`sqlite3`, as :func:`rows` does),
    or a PostgreSQL URL (one autocommit connection, opened at first use: every
    statement sees what is committed; :meth:`close` it before the schema goes).
    Statements use ``?`` placeholders on both; a literal ``%`` needs no escaping.
    """

    def __init__(self, root: Path, db_url: str | None = None) -> None:
        self.root = root
        self.db_url = db_url
        self._engine: Engine | None = None
        self._conn: Connection | None = None

    @property
    def is_sqlite(self) -> bool:
        return self.db_url is None

    def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        if self.db_url is None:
            return rows(self.root, sql, *args)
        return [tuple(r) for r in self._pg().exec_driver_sql(*_pyformat(sql, args))]

    def execute(self, sql: str, *args: Any) -> None:
        """Change the ledger behind ckptdb's back (and commit), as an operator could."""
        if self.db_url is None:
            con = sqlite3.connect(self.root / "ckptdb.sqlite")
            try:
                with con:
                    con.execute(sql, args)
            finally:
                con.close()
        else:
            self._pg().exec_driver_sql(*_pyformat(sql, args))

    def tables(self) -> list[str]:
        """The ledger's tables (alembic's included), sorted."""
        if self.db_url is None:
            query = "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
        else:
            query = (
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema() AND table_type = 'BASE TABLE' "
                "ORDER BY table_name"
            )
        return [name for (name,) in self.rows(query)]

    def _pg(self) -> Connection:
        if self._conn is None:
            assert self.db_url is not None
            engine = create_engine(self.db_url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
            self._engine, self._conn = engine, engine.connect()
        return self._conn

    def close(self) -> None:
        conn, engine = self._conn, self._engine
        self._conn = self._engine = None
        if conn is not None:
            conn.close()
        if engine is not None:
            engine.dispose()


def _pyformat(sql: str, args: tuple[Any, ...]) -> tuple[str, tuple[Any, ...] | None]:
    """``?`` placeholders as psycopg's ``%s`` (a statement without arguments is left as is)."""
    if not args:
        return sql, None
    return sql.replace("%", "%%").replace("?", "%s"), args


_ParameterSet = type(pytest.param())


def on_both_backends(
    cases: Iterable[Any], *, postgres: Callable[[Any], bool], ids: Callable[[Any], str] = str
) -> list[Any]:
    """``(backend, *case)`` for ``parametrize(("backend", ...), ..., indirect=["backend"])``.

    Every case runs on SQLite; on PostgreSQL only those ``postgres(case)`` picks
    (for a ``pytest.param`` case: ``postgres(its id)``). For cases that differ in
    what the ledger never sees (a file name, a path, an argument refused before
    any ledger work), where one or two represent them there.
    """
    out = []
    for backend in ("sqlite", "postgres"):
        for case in cases:
            if isinstance(case, _ParameterSet):
                values, name, marks, key = tuple(case.values), str(case.id), case.marks, case.id
            else:
                values, name, marks, key = (case,), ids(case), (), case
            if backend == "sqlite" or postgres(key):
                out.append(pytest.param(backend, *values, id=f"{backend}-{name}", marks=marks))
    return out


def child_app_name(pid: int) -> str:
    """The ``application_name`` of a test child's PostgreSQL sessions (set as
    ``PGAPPNAME`` by the child itself) but its writer lock's: ckptdb names that one
    ``ckptdb pid=<pid> host=<host>``."""
    return f"ckptdb-test pid={pid}"


def await_sessions_gone(db_url: str | None, pid: int, timeout: float = 30) -> None:
    """Wait until the server has ended every PostgreSQL session of dead process ``pid``.

    The server ends the session of a client that died when it reads the closed
    socket: at once, or nearly, but not in step with the client's death. Until
    then the run's advisory lock may still be held (a reopen is refused), and a
    COMMIT the client sent just before dying may still be in progress (the ledger
    read now would not be the one a reopen sees). Sessions are told apart by
    ``application_name``: ckptdb's for the lock, :func:`child_app_name` for the
    rest. Nothing to wait for on SQLite (``db_url`` None).
    """
    if db_url is None:
        return
    deadline = time.monotonic() + timeout
    while True:
        with pg_admin(db_url) as conn:
            left = conn.exec_driver_sql(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND (application_name LIKE %s OR application_name = %s)",
                (f"ckptdb pid={pid} %", child_app_name(pid)),
            ).scalar()
        if not left:
            return
        assert time.monotonic() < deadline, f"the sessions of dead process {pid} never ended"
        time.sleep(0.01)


def files(directory: Path) -> list[str]:
    """Every file under ``directory``, relative, sorted (symlinks included)."""
    if not directory.exists():
        return []
    return sorted(
        str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() or p.is_symlink()
    )


def digest(path: Path) -> str:
    return xxhash.xxh3_128(Path(path).read_bytes()).hexdigest()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def disk(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` with its content hash."""
    return {name: digest(directory / name) for name in files(directory)}


def tree(directory: Path) -> dict[str, str]:
    """Every entry under ``directory`` (symlinks not followed) with a content digest."""
    out: dict[str, str] = {}
    if not directory.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(directory).as_posix()
            if path.is_symlink():
                out[rel] = "link->" + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def patch_unpickle(patch: pytest.MonkeyPatch, wrap: Callable[[Any], Any]) -> None:
    """Replace every way a load unpickles (``torch.load``, and the held-records loader
    of :mod:`ckptdb.storage.heldfile`) with ``wrap(real)``; both take ``map_location``
    and ``weights_only`` as keywords."""
    import ckptdb.storage.heldfile as heldfile

    patch.setattr(torch, "load", wrap(torch.load))
    patch.setattr(heldfile, "unpickle", wrap(heldfile.unpickle))


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Flip one byte in place (the middle one by default); the size stays the same."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def db_locked(statement: str) -> sqlalchemy.exc.OperationalError:
    """The error SQLAlchemy raises when SQLite's busy timeout runs out."""
    return sqlalchemy.exc.OperationalError(
        statement, {}, sqlite3.OperationalError("database is locked")
    )


def ledger_rows(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """Query any ledger (SQLite or PostgreSQL URL) directly, with ``:name`` parameters."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def schema_diff(url: str) -> list[Any]:
    """What differs between the migrated schema and ``ckptdb.ledger.models`` (empty: nothing)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from ckptdb.ledger.models import Base

    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return list(compare_metadata(MigrationContext.configure(conn), Base.metadata))
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


@contextlib.contextmanager
def pg_schema(url: str, name: str) -> Iterator[str]:
    """Schema ``name`` (as SQL spells it: quoted if it must be) for the block, dropped
    after with everything in it."""
    with pg_admin(url) as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {name}")
    try:
        yield name
    finally:
        with pg_admin(url) as conn:
            conn.exec_driver_sql("SET lock_timeout = '20s'")
            conn.exec_driver_sql(f"DROP SCHEMA {name} CASCADE")


def migrate_to(url: str, revision: str, *, down: bool = False) -> None:
    """Alembic ``upgrade`` (or ``downgrade``) of the ledger at ``url``, in one transaction."""
    engine = create_engine(url, poolclass=NullPool)
    cfg = alembic_config()
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, revision)
    finally:
        engine.dispose()


def ledger_objects(url: str) -> tuple[set[str], set[str], str]:
    """(tables, views, schema revision) of the ledger at ``url``."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
            insp = inspect(conn)
            return set(insp.get_table_names()), set(insp.get_view_names()), version
    finally:
        engine.dispose()


def run_script(
    tmp_path: Path, code: str, *args: str, name: str = "child.py"
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) as a script in ``tmp_path``, in a fresh interpreter."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        cwd=tmp_path,
        check=False,
    )


# ------------------------------------------------------------------------ the CLI


def console_script() -> str:
    """The installed ``ckptdb`` command (beside this interpreter, else on PATH)."""
    beside = Path(sys.executable).parent / "ckptdb"
    return str(beside) if beside.exists() else (shutil.which("ckptdb") or "ckptdb")


def invoke(runner: CliRunner, *args: Any) -> Result:
    """``ckptdb ARGS`` in-process."""
    return runner.invoke(main, [str(a) for a in args])


def cli_subprocess(*args: Any, cwd: Path | None = None, timeout: float = 120) -> Any:
    """``ckptdb ARGS`` as a real process (without ``CKPTDB_DB_URL`` from the environment)."""
    return subprocess.run(
        [console_script(), *(str(a) for a in args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != "CKPTDB_DB_URL"},
        check=False,
    )


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


def remove_copy_while_downloaded(
    monkeypatch: pytest.MonkeyPatch, db: LedgerClient, step: int
) -> None:
    """What a replicator's remote window does between a restore's query and its GET: the
    copies of the checkpoints at ``step`` marked ``deleted``, and their GET answered
    NoSuchKey (the other copies download as always)."""
    import ckptdb.errors
    import ckptdb.storage.s3

    download = ckptdb.storage.s3.S3Store.download

    def removed_meanwhile(store: Any, rel: str, sink: Any) -> Any:
        if f"step-{step:09d}" not in rel:
            return download(store, rel, sink)
        db.execute(
            "UPDATE replicas SET state = 'deleted' WHERE checkpoint_id IN "
            "(SELECT id FROM checkpoints WHERE step = ?)",
            step,
        )
        raise ckptdb.errors.ObjectStoreError(f"GetObject {rel}: NoSuchKey")

    monkeypatch.setattr(ckptdb.storage.s3.S3Store, "download", removed_meanwhile)


class _Freed:
    pass


def raise_a_dropped_interrupt() -> None:
    """SIGINT from inside a weakref callback: Python drops the KeyboardInterrupt it
    raises there ("Exception ignored in ..."), as it does with a Ctrl-C that lands while
    an object (an evaluation's pin, its thread) is freed."""
    freed = _Freed()
    ref = weakref.ref(freed, lambda _: signal.raise_signal(signal.SIGINT))
    del freed  # the callback runs now
    assert ref() is None
