"""Revision 0003 on PostgreSQL: 64-bit steps, with ckptdb's views dropped and created
again around the change. What the views carried (grants, comments) survives, the
ledger's own schema is found wherever it is on the search path, and the revision
also runs offline (``alembic upgrade --sql``).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import migrate_to, pg_admin, pg_schema, pg_schema_url
from sqlalchemy import create_engine, inspect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from ckptdb import CheckpointManager, Keep, RunReader
from ckptdb.ledger.engine import newest_revision
from ckptdb.ledger.models import VIEW_NAMES

REPO = Path(__file__).resolve().parents[1]


def scalar(url: str, sql: str) -> object:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return conn.exec_driver_sql(sql).scalar()
    finally:
        engine.dispose()


def save_at_a_64_bit_step(root: Path, url: str) -> None:
    with CheckpointManager(root, db_url=url, streams={"model": Keep(last=None)}) as mgr:
        mgr.save(2**40, metrics={"loss": 0.5}, model={"w": torch.ones(2)})


@pytest.fixture
def reader_role(postgres_url: str) -> Iterator[str]:
    role = f"ckptdb_reader_{secrets.token_hex(4)}"
    with pg_admin(postgres_url) as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role}")
    try:
        yield role
    finally:
        with pg_admin(postgres_url) as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")


def test_grants_and_comments_on_the_views_survive_the_upgrade(
    pg_url: str, tmp_path: Path, reader_role: str
) -> None:
    """A dashboard's read-only role keeps reading the views, and their comments stay:
    DROP VIEW loses both, and CREATE VIEW does not bring them back."""
    migrate_to(pg_url, "0002")
    engine = create_engine(pg_url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"GRANT SELECT ON latest_checkpoints TO {reader_role}")
            conn.exec_driver_sql(f"GRANT SELECT ON attempt_summary TO {reader_role}")
            conn.exec_driver_sql("COMMENT ON VIEW latest_checkpoints IS 'dashboards read this'")
    finally:
        engine.dispose()
    save_at_a_64_bit_step(tmp_path / "run", pg_url)
    for view in ("latest_checkpoints", "attempt_summary"):
        assert scalar(pg_url, f"SELECT has_table_privilege('{reader_role}', '{view}', 'SELECT')")
    assert not scalar(pg_url, f"SELECT has_table_privilege('{reader_role}', 'runs', 'SELECT')")
    assert not scalar(
        pg_url, f"SELECT has_table_privilege('{reader_role}', 'best_checkpoints', 'SELECT')"
    )
    comment = "SELECT obj_description('latest_checkpoints'::regclass, 'pg_class')"
    assert scalar(pg_url, comment) == "dashboards read this"


@pytest.fixture
def mixed_case_url(postgres_url: str) -> Iterator[str]:
    with pg_schema(postgres_url, f'"Ledger_{secrets.token_hex(4)}"') as schema:
        yield pg_schema_url(postgres_url, schema)


def test_a_ledger_in_a_mixed_case_schema_upgrades(mixed_case_url: str, tmp_path: Path) -> None:
    """The ledger's schema is named as PostgreSQL quotes it: read back unquoted, a
    mixed-case name turned lowercase and named a schema that does not exist."""
    migrate_to(mixed_case_url, "0002")
    save_at_a_64_bit_step(tmp_path / "run", mixed_case_url)
    with RunReader(tmp_path / "run", db_url=mixed_case_url) as reader:
        assert reader.sql("SELECT step FROM latest_checkpoints")[1] == [(2**40,)]


def test_the_views_are_created_again_in_the_ledgers_schema(
    pg_url: str, postgres_url: str, tmp_path: Path
) -> None:
    """With another schema ahead of the ledger's on the search path, the views were
    dropped from the ledger's schema and created in the other one."""
    migrate_to(pg_url, "0002")
    ledger_schema = pg_url.split("search_path%3D")[-1]
    with pg_schema(postgres_url, f"ahead_{secrets.token_hex(4)}") as ahead:
        both = pg_schema_url(postgres_url, f"{ahead},{ledger_schema}")
        save_at_a_64_bit_step(tmp_path / "run", both)
        engine = create_engine(postgres_url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                assert set(inspect(conn).get_view_names(schema=ahead)) == set()
                assert set(inspect(conn).get_view_names(schema=ledger_schema)) == set(VIEW_NAMES)
        finally:
            engine.dispose()
        with RunReader(tmp_path / "run", db_url=pg_url) as reader:
            assert reader.sql("SELECT step FROM latest_checkpoints")[1] == [(2**40,)]


def test_the_revision_renders_offline_as_sql(pg_url: str) -> None:
    """``alembic upgrade --sql`` writes the script without a database to ask: the
    checks that query the catalog are left out, the statements are all there."""
    alembic = [sys.executable, "-m", "alembic", "-c", str(REPO / "alembic.ini")]
    done = subprocess.run(
        [*alembic, "-x", f"db_url={pg_url}", "upgrade", "0002:0003", "--sql"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    script = done.stdout
    for table in ("checkpoints", "metrics", "events"):
        assert f"ALTER TABLE {table} ALTER COLUMN step TYPE BIGINT" in script
    for column in ("keep_last", "keep_every", "k"):
        assert f"ALTER TABLE streams ALTER COLUMN {column} TYPE BIGINT" in script
    for view in VIEW_NAMES:
        assert f"DROP VIEW {view}" in script and f"CREATE VIEW {view} AS" in script
    assert "UPDATE alembic_version SET version_num='0003'" in script


def test_metric_ids_pass_32_bits(pg_url: str, tmp_path: Path) -> None:
    """One row per point, shared by every run of the database: ids and their sequence
    are 64-bit, so the 2**31-th point of a database is stored like the first."""
    root = tmp_path / "run"
    with CheckpointManager(root, db_url=pg_url, streams={"model": Keep(last=None)}) as mgr:
        assert scalar(pg_url, f"SELECT setval('metrics_id_seq', {2**31 + 5})") == 2**31 + 5
        mgr.log_metrics(1, {"loss": 0.5})
    assert scalar(pg_url, "SELECT id FROM metrics") == 2**31 + 6
    sequence_type = "SELECT data_type FROM information_schema.sequences"
    assert scalar(pg_url, f"{sequence_type} WHERE sequence_name = 'metrics_id_seq'") == "bigint"
    with pytest.raises(DBAPIError):  # back to 32-bit ids: refused, nothing changes
        migrate_to(pg_url, "0002", down=True)
    # the whole downgrade is one transaction: the revisions above 0003 are back too
    assert scalar(pg_url, "SELECT version_num FROM alembic_version") == newest_revision()
