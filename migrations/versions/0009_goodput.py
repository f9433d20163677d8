"""goodput: each attempt's progress and blocked time, each boundary's place in it

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07

A run's goodput (docs/goodput.md) splits its wall-clock time into training
that survived, saving, work redone after a failure, restarts and idle gaps.
The ledger knew when attempts started and ended, but not when a crashed
attempt died (its end is stamped by the next open), when its first step ran
or how long its loop waited in saves. Each attempt now records
``launched_at`` (its process's start), ``first_step_at``, ``last_step``,
``seen_at`` (its last heartbeat), ``saving_s`` and ``saves``; each
checkpoint row records ``saving_before_s``, the attempt's blocked seconds
when its boundary began. Only additions: upgrading keeps every row (older
attempts have NULLs, which the report reads as "not measured"); downgrading
drops the columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from ckptdb.errors import SchemaVersionError

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INT64 = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


COLUMNS = {
    "attempts": (
        ("launched_at", sa.DateTime()),
        ("first_step_at", sa.DateTime()),
        ("last_step", INT64),
        ("seen_at", sa.DateTime()),
        ("saving_s", sa.Float()),
        ("saves", sa.Integer()),
    ),
    "checkpoints": (("saving_before_s", sa.Float()),),
}


def upgrade() -> None:
    for table, columns in COLUMNS.items():
        for name, kind in columns:
            op.add_column(table, sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite" and bind.dialect.dbapi.sqlite_version_info < (3, 35, 5):
        # batch mode would rebuild the tables, which SQLite refuses while ckptdb's views
        # name them (see 0005)
        raise SchemaVersionError(
            "downgrading below 0009 needs SQLite 3.35.5 or newer (ALTER TABLE ... DROP "
            "COLUMN); nothing was changed"
        )
    for table, columns in COLUMNS.items():
        for name, _ in reversed(columns):
            op.drop_column(table, name)
