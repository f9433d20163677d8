"""derived aliases

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05

Adds the ``aliases`` table: the names other tools open (DeePMD's
``model.ckpt.pt`` symlink and ``checkpoint`` pointer file, a hard-linked
``last.ckpt``) that an integration registered, so that reconcile re-points
them at the latest committed checkpoint of their stream after a crash between
a commit and its aliases. Only an addition: upgrading keeps every row,
downgrading drops the table (the aliases on disk stay as they are; nothing
re-points them any more but the integration that wrote them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "aliases",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("stream", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id", "stream"],
            ["streams.run_id", "streams.name"],
            name=op.f("fk_aliases_run_id_streams"),
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_aliases_run_id_runs")),
        sa.PrimaryKeyConstraint("run_id", "path", name=op.f("pk_aliases")),
    )


def downgrade() -> None:
    op.drop_table("aliases")
