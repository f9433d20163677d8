"""exports and trackers: checkpoints handed to the ecosystem

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07

``ckptdb export`` writes a committed checkpoint in another format (Hugging
Face safetensors) into a directory of the user's choosing. Each complete
export is one row of ``exports``: the checkpoint it derives from, the
format, its absolute path, its total size and hash, and a manifest of its
files (JSON ``[[name, size, hash], ...]``) that ``ckptdb check`` verifies.
Each experiment tracker a follower mirrors the run into (``ckptdb follow
--to mlflow|wandb``) is one row of ``trackers``: the tracker's own run id
(one tracker run for one ckptdb run, across restarts), the cursor of the
metrics mirrored so far and what was mirrored of the checkpoints (JSON).
New tables only: upgrading keeps every row; downgrading drops them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INT64 = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "exports",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("format", sa.String(length=32), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("size", INT64, nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("manifest", sa.Text(), nullable=False),
        sa.Column("tensors", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_exports_checkpoint_id_checkpoints")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_exports_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_exports")),
    )
    op.create_index("ix_exports_run_checkpoint", "exports", ["run_id", "checkpoint_id"])
    op.create_table(
        "trackers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("external_id", sa.String(length=255), nullable=True),
        sa.Column("metric_cursor", INT64, nullable=False),
        sa.Column("mirrored", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_trackers_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trackers")),
    )
    op.create_index(
        "ux_trackers_run_kind_target", "trackers", ["run_id", "kind", "target"], unique=True
    )


def downgrade() -> None:
    op.drop_index("ux_trackers_run_kind_target", table_name="trackers")
    op.drop_table("trackers")
    op.drop_index("ix_exports_run_checkpoint", table_name="exports")
    op.drop_table("exports")
