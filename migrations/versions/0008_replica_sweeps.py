"""replicas.swept_at: when a failed copy's prefix was last swept

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06

A copy marked ``failed`` (a timeout, a lost connection) can still land at the
server afterwards: a PUT the server completes after the client gave up. The
replicator sweeps a failed copy's prefix until some time after it failed, and
``swept_at`` records its last sweep (NULL: never swept). Only an addition:
upgrading keeps every row (each failed copy is swept once more); downgrading
drops the column.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("swept_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("swept_at")
