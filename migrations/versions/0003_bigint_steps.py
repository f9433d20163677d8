"""64-bit steps on PostgreSQL

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

The ``step`` columns of ``checkpoints``, ``metrics`` and ``events`` were
``INTEGER``: 64-bit on SQLite, but 32-bit on PostgreSQL, where a run that
counts its steps in samples or tokens passes 2**31 - 1 within days. They become
``BIGINT`` there; on SQLite nothing changes (its ``INTEGER`` already holds
64 bits), so this revision does nothing on SQLite.

PostgreSQL refuses to change the type of a column that a view reads, so
ckptdb's views are dropped first and then created again from their SQL as
revisions 0001 and 0002 wrote it (read from those revisions' files, so that
there is one text of each). A view of the user's own that reads these columns
or ckptdb's views is never dropped: the revision refuses to start, naming it
(``SchemaVersionError``), and nothing changes.

The change rewrites the three tables (``metrics`` is the large one): a one-time
cost at the first open by a ckptdb that has this revision, under the
migration lock. Downgrading turns the columns back into ``INTEGER``; PostgreSQL
refuses it (``integer out of range``), changing nothing, while any step is
past 2**31 - 1.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

from ckptdb.errors import SchemaVersionError

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STEP_COLUMNS = (("checkpoints", False), ("metrics", False), ("events", True))


def upgrade() -> None:
    _retype_steps(sa.Integer(), sa.BigInteger())


def downgrade() -> None:
    _retype_steps(sa.BigInteger(), sa.Integer())


def _retype_steps(old: sa.types.TypeEngine[int], new: sa.types.TypeEngine[int]) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite's INTEGER is 64-bit already
    views = views_of_0002()
    _refuse_views_of_others(list(views))
    for name in reversed(list(views)):
        op.execute(f"DROP VIEW {name}")
    for table, nullable in STEP_COLUMNS:
        op.alter_column(table, "step", existing_type=old, type_=new, existing_nullable=nullable)
    for name, sql in views.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def _refuse_views_of_others(ours: list[str]) -> None:
    """A view that is not ckptdb's and reads a step column or one of ckptdb's views
    would make the change fail half-way (PostgreSQL's message names only the view
    it could not drop): refused up front, by name, before anything is changed."""
    found = (
        op.get_bind()
        .execute(
            sa.text(
                """
            SELECT DISTINCT dependent.relname
            FROM pg_depend d
            JOIN pg_rewrite r ON r.oid = d.objid
            JOIN pg_class dependent ON dependent.oid = r.ev_class
            JOIN pg_class used ON used.oid = d.refobjid
            LEFT JOIN pg_attribute a ON a.attrelid = used.oid AND a.attnum = d.refobjsubid
            WHERE used.relnamespace = current_schema()::regnamespace
              AND dependent.oid <> used.oid
              AND NOT dependent.relname = ANY(:ours)
              AND (used.relname = ANY(:ours)
                   OR (used.relname = ANY(:tables) AND a.attname = 'step'))
            ORDER BY 1
            """
            ),
            {"ours": ours, "tables": [table for table, _ in STEP_COLUMNS]},
        )
        .scalars()
    )
    others = list(found)
    if others:
        raise SchemaVersionError(
            "schema revision 0003 widens the ledger's step columns to 64 bits, which "
            "PostgreSQL allows only after dropping the views that read them; "
            f"these views depend on them and are not ckptdb's: {', '.join(others)}. "
            "Drop them, open the run (or run `ckptdb db upgrade`), then create them again"
        )


def views_of_0002() -> dict[str, str]:
    """Every view as revision 0002 left it, in creation order: 0001's, with 0002's
    ``best_checkpoints``, then 0002's ``checkpoint_evaluations``."""
    initial, pins = _revision("0001_initial.py"), _revision("0002_pins_evaluations.py")
    views: dict[str, str] = dict(initial.VIEWS)
    views["best_checkpoints"] = pins.BEST_AFTER
    views["checkpoint_evaluations"] = pins.CHECKPOINT_EVALUATIONS
    return views


def _revision(file_name: str) -> ModuleType:
    """An earlier revision's module, loaded from its file beside this one (revisions
    are files Alembic loads by path, not an importable package)."""
    path = Path(__file__).with_name(file_name)
    spec = importlib.util.spec_from_file_location(f"_ckptdb_revision_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
