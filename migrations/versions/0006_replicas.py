"""replicas: copies of checkpoints on another tier

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05

Adds ``replicas``: one row per copy of a checkpoint on another tier (object
storage), with its location, its state (``uploading``, ``replicated``,
``failed``), its size and hash, and the manifest of its files. Only an
addition: upgrading keeps every row; downgrading drops the table (the copies
on object storage stay where they are, no longer recorded).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("size", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("hash", sa.String(length=64), nullable=True),
        sa.Column("manifest", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_replicas_checkpoint_id_checkpoints"),
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_replicas_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replicas")),
    )
    op.create_index(
        "ix_replicas_run_tier_state", "replicas", ["run_id", "tier", "state"], unique=False
    )
    op.create_index("ix_replicas_checkpoint_id", "replicas", ["checkpoint_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_replicas_checkpoint_id", table_name="replicas")
    op.drop_index("ix_replicas_run_tier_state", table_name="replicas")
    op.drop_table("replicas")
