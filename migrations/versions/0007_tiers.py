"""tiers: a run's registered second tier and its retention

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06

Adds ``tiers``: one row per run and tier (``remote``) a replicator has
registered, with the copies' location, the streams it copies (NULL: every
stream) and each stream's retention on that tier (JSON; a stream not named
keeps every copy). While a row exists, a local checkpoint of a copied stream
that retention evicts keeps its file until its copy is whole (a pin held by
the replication). Only an addition: upgrading keeps every row; downgrading
drops the table and releases the holds (their pins): the held files go at the
next commit, ``gc`` or reconcile.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tiers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("streams", sa.Text(), nullable=True),
        sa.Column("policies", sa.Text(), nullable=True),
        sa.Column("registered_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_tiers_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tiers")),
    )
    op.create_index("ux_tiers_run_tier", "tiers", ["run_id", "tier"], unique=True)


def downgrade() -> None:
    # the holds go with the registration: released, their files go at the next commit
    pins = sa.table(
        "pins", sa.column("holder", sa.String()), sa.column("released_at", sa.DateTime())
    )
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)  # naive UTC, as ckptdb's
    op.execute(
        pins.update()
        .where(pins.c.holder.like("ckptdb.replication:%"), pins.c.released_at.is_(None))
        .values(released_at=now)
    )
    op.drop_index("ux_tiers_run_tier", table_name="tiers")
    op.drop_table("tiers")
