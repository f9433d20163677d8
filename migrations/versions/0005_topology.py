"""topology: the world size of every attempt and checkpoint

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05

Adds ``attempts.world_size`` (the ranks an attempt ran on),
``checkpoints.world_size`` (the ranks that saved a checkpoint) and
``checkpoints.topology`` (for a sharded payload, JSON describing the device
meshes of its DTensors), so that a job resumed on another number of ranks is
detected and said, and history answers "on how many ranks was this saved".
Only additions: rows already there keep NULL (unknown); downgrading drops the
three columns and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from ckptdb.errors import SchemaVersionError

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("attempts", sa.Column("world_size", sa.Integer(), nullable=True))
    op.add_column("checkpoints", sa.Column("world_size", sa.Integer(), nullable=True))
    op.add_column("checkpoints", sa.Column("topology", sa.Text(), nullable=True))


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite" and bind.dialect.dbapi.sqlite_version_info < (3, 35, 5):
        # batch mode would rebuild the tables, which SQLite refuses while ckptdb's views
        # name them; ALTER TABLE ... DROP COLUMN arrived in 3.35 and could move a dropped
        # column's values into another before 3.35.5
        raise SchemaVersionError(
            "downgrading below 0005 needs SQLite 3.35.5 or newer (ALTER TABLE ... DROP "
            "COLUMN); nothing was changed"
        )
    op.drop_column("checkpoints", "topology")
    op.drop_column("checkpoints", "world_size")
    op.drop_column("attempts", "world_size")
