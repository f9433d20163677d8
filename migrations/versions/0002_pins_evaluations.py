"""pins, evaluations, and an index for followers

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

The first migration that runs on ledgers users already have. It only adds:
the ``pins`` table (readers' leases on checkpoints), the ``evaluations``
table and its ``checkpoint_evaluations`` view, and an index on checkpoints
``(run_id, stream, id)`` for followers. ``best_checkpoints`` is redefined to
leave out checkpoints saved without the ranking metric (a ``TopK(last=N)``
stream may hold some; they are never among the best).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here, as in 0001: a later change to the models cannot alter this revision.
BEST_BEFORE = """
        SELECT c.run_id AS run_id, c.stream AS stream, c.step AS step, c.path AS path,
               c.metric AS metric, s.metric AS metric_name, s.mode AS mode,
               ROW_NUMBER() OVER (
                   PARTITION BY c.run_id, c.stream
                   ORDER BY CASE WHEN s.mode = 'max' THEN -c.metric ELSE c.metric END, c.step
               ) AS rank,
               c.id AS checkpoint_id
        FROM checkpoints c
        JOIN streams s ON s.run_id = c.run_id AND s.name = c.stream
        WHERE s.kind = 'topk' AND c.state = 'committed'
"""
BEST_AFTER = BEST_BEFORE.replace(
    "WHERE s.kind = 'topk' AND c.state = 'committed'",
    "WHERE s.kind = 'topk' AND c.state = 'committed' AND c.metric IS NOT NULL",
)
CHECKPOINT_EVALUATIONS = """
        SELECT e.run_id AS run_id, c.stream AS stream, c.step AS step, c.path AS path,
               c.state AS state, e.evaluator AS evaluator, e.name AS name,
               e.value AS value, e.recorded_at AS recorded_at,
               c.id AS checkpoint_id, e.id AS evaluation_id
        FROM evaluations e JOIN checkpoints c ON c.id = e.checkpoint_id
"""


def upgrade() -> None:
    op.create_table(
        "pins",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("released_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_pins_checkpoint_id_checkpoints")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_pins_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pins")),
    )
    with op.batch_alter_table("pins", schema=None) as batch_op:
        batch_op.create_index("ix_pins_run_checkpoint", ["run_id", "checkpoint_id"], unique=False)

    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("evaluator", sa.String(length=255), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("recorded_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_evaluations_checkpoint_id_checkpoints"),
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_evaluations_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluations")),
    )
    with op.batch_alter_table("evaluations", schema=None) as batch_op:
        batch_op.create_index(
            "ix_evaluations_run_name_value", ["run_id", "name", "value"], unique=False
        )
        batch_op.create_index(
            "ux_evaluations_checkpoint_evaluator_name",
            ["checkpoint_id", "evaluator", "name"],
            unique=True,
        )

    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index(
            "ix_checkpoints_run_stream_id", ["run_id", "stream", "id"], unique=False
        )

    op.execute("DROP VIEW best_checkpoints")
    op.execute(f"CREATE VIEW best_checkpoints AS {BEST_AFTER}")
    op.execute(f"CREATE VIEW checkpoint_evaluations AS {CHECKPOINT_EVALUATIONS}")


def downgrade() -> None:
    op.execute("DROP VIEW checkpoint_evaluations")
    op.execute("DROP VIEW best_checkpoints")
    op.execute(f"CREATE VIEW best_checkpoints AS {BEST_BEFORE}")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoints_run_stream_id")
    with op.batch_alter_table("evaluations", schema=None) as batch_op:
        batch_op.drop_index("ux_evaluations_checkpoint_evaluator_name")
        batch_op.drop_index("ix_evaluations_run_name_value")
    op.drop_table("evaluations")
    with op.batch_alter_table("pins", schema=None) as batch_op:
        batch_op.drop_index("ix_pins_run_checkpoint")
    op.drop_table("pins")
